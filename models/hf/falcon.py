"""Falcon (TII; rotary models: Falcon-7B, -40B, -180B): q|k|v fused in ``query_key_value`` by key
head (each kv group's queries, then its key and its value: multi-query's one group of all queries,
classic MHA's one query per group), the output ``dense``, a plain GELU MLP (``dense_h_to_4h``,
``dense_4h_to_h``), one ``bias`` flag for all of them, rotary embeddings on every feature, and a
LayerNorm'd block in one of three forms: sequential (``parallel_attn`` false: input and
post-attention LayerNorms), parallel from one LayerNorm (``parallel_attn``: Falcon-7B; or the new
decoder architecture with ``num_ln_in_parallel_attn`` 1), or parallel from two (the new decoder
architecture: ``ln_attn``, ``ln_mlp``, Falcon-40B); a final LayerNorm, the head tied by default.
ALiBi models (``alibi``) are refused.
"""

from __future__ import annotations

from shardzoo.models.hf import llama, phi
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    Weight,
    rope,
    rope_to_hf,
    special_tokens,
)

PREFIX = "transformer."
# FalconConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
              num_ln_in_parallel_attn=None, layer_norm_epsilon=1e-5, initializer_range=0.02, use_cache=True,
              hidden_dropout=0.0, attention_dropout=0.0, num_kv_heads=None, alibi=False, new_decoder_architecture=False,
              multi_query=True, parallel_attn=True, bias=False, max_position_embeddings=2048, rope_parameters=None,
              bos_token_id=11, eos_token_id=11, pad_token_id=None, ffn_hidden_size=None, activation="gelu",
              tie_word_embeddings=True)
FEATURES = (llama.ROTARY - {"rmsnorm", "gated_mlp"}) | {
    "layernorm", "parallel_residual", "parallel_two_norms", "plain_mlp", "attention_bias", "attention_out_bias",
    "mlp_bias"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, "num_key_value_heads")  # num_key_value_heads: what FalconConfig derives from the rest
    if hf.get("alibi"):
        raise hf.refuse("alibi", "shardzoo's falcon runs the rotary models (ALiBi is not implemented)")
    hf.require("hidden_size", "num_hidden_layers", "num_attention_heads")
    d, heads, bias = hf.get("hidden_size"), hf.get("num_attention_heads"), hf.get("bias")
    new, parallel, norms = hf.get("new_decoder_architecture"), hf.get("parallel_attn"), hf.get("num_ln_in_parallel_attn")
    kv = hf.get("num_kv_heads") or heads
    if new:
        if not parallel:
            raise hf.refuse("parallel_attn", "the new decoder architecture runs attention and MLP side by side "
                                             "(transformers has no sequential form of it)")
        form = "parallel" if norms == 1 else "parallel_two_norms"
        hf.ignore("multi_query")  # the new architecture's kv heads are num_kv_heads
    else:
        if norms not in (None, 1):
            raise hf.refuse("num_ln_in_parallel_attn", "two norms come with new_decoder_architecture only")
        if not hf.get("multi_query") and kv != heads:
            raise hf.refuse("num_kv_heads", f"without multi_query or the new decoder architecture every one of the "
                                            f"{heads} heads has its key and value")
        kv = 1 if hf.get("multi_query") else heads
        form = "parallel" if parallel else "sequential"
    out = rope(hf)
    del out["partial_rotary_factor"]  # Falcon rotates every feature
    return out | dict(
        vocab_size=hf.get("vocab_size"), hidden_size=d, intermediate_size=hf.get("ffn_hidden_size") or 4 * d,
        num_hidden_layers=hf.get("num_hidden_layers"), num_attention_heads=heads, num_key_value_heads=kv,
        max_position_embeddings=hf.get("max_position_embeddings"), rms_norm_eps=hf.get("layer_norm_epsilon"),
        initializer_range=hf.get("initializer_range"), hidden_act=hf.get("activation"),
        tie_word_embeddings=hf.get("tie_word_embeddings"), norm_type="layernorm", mlp_type="plain", block_form=form,
        attention_bias=bias, attention_out_bias=bias, mlp_bias=bias, **special_tokens(hf))


def to_hf(a) -> dict:
    """The classic layout where it expresses the model (one kv head or all of them, one norm or a
    sequential block), else the new decoder architecture."""
    classic = a.block_form != "parallel_two_norms" and a.kv_heads in (1, a.num_attention_heads)
    out = dict(hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers,
               num_attention_heads=a.num_attention_heads, num_kv_heads=a.kv_heads,
               ffn_hidden_size=a.intermediate_size, max_position_embeddings=a.max_position_embeddings,
               layer_norm_epsilon=a.rms_norm_eps, activation=a.hidden_act, bias=a.attention_bias, alibi=False,
               new_decoder_architecture=not classic, multi_query=classic and a.kv_heads == 1,
               parallel_attn=a.block_form != "sequential",
               num_ln_in_parallel_attn=None if classic else 2 if a.block_form == "parallel_two_norms" else 1)
    return out | rope_to_hf(a)


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), PREFIX + "word_embeddings.weight")] + phi._both(("final_norm",), PREFIX + "ln_f")
    return out if a.tie_word_embeddings else out + [Weight(("lm_head", "kernel"), "lm_head.weight", "linear")]


def layer_weights(a, spec) -> list[Weight]:
    h, kv = PREFIX + "h.{i}.", a.kv_heads
    norms = {"sequential": (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")),
             "parallel": (("attn_norm", "input_layernorm"),),
             "parallel_two_norms": (("attn_norm", "ln_attn"), ("mlp_norm", "ln_mlp"))}[a.block_form]
    out = [w for leaf, name in norms for w in phi._both((leaf,), h + name)]
    widths = (a.num_attention_heads // kv, 1, 1)  # each kv group: its queries, its key, its value
    for j, n in enumerate("qkv"):
        out.append(Weight(("attn", n, "kernel"), h + "self_attention.query_key_value.weight", "linear", part=(j, 3),
                          widths=widths, groups=kv))
        if a.attention_bias:
            out.append(Weight(("attn", n, "bias"), h + "self_attention.query_key_value.bias", "vec", part=(j, 3),
                              widths=widths, groups=kv))
    out.append(Weight(("attn", "o", "kernel"), h + "self_attention.dense.weight", "linear", n_in=2))
    for leaf, name in (("up", "dense_h_to_4h"), ("down", "dense_4h_to_h")):
        out.append(Weight(("mlp", leaf, "kernel"), h + f"mlp.{name}.weight", "linear"))
    if a.attention_bias:
        out.append(Weight(("attn", "o", "bias"), h + "self_attention.dense.bias", "vec"))
        out += [Weight(("mlp", leaf, "bias"), h + f"mlp.{name}.bias", "vec")
                for leaf, name in (("up", "dense_h_to_4h"), ("down", "dense_4h_to_h"))]
    return out


BASE = dict(norm_type="layernorm", mlp_type="plain", block_form="parallel", hidden_act="gelu", rms_norm_eps=1e-5,
            tie_word_embeddings=True, bos_token_id=11, eos_token_id=11)
FALCON = Family(
    "falcon", ("falcon",), "FalconForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    presets={
        # tiiuae/falcon-7b/config.json: multi-query, attention and MLP from one LayerNorm
        "falcon-7b": BASE | dict(vocab_size=65024, hidden_size=4544, intermediate_size=4 * 4544, num_hidden_layers=32,
                                 num_attention_heads=71, num_key_value_heads=1, max_position_embeddings=2048),
        # tiiuae/falcon-40b/config.json: the new decoder architecture, 8 kv heads, two LayerNorms
        "falcon-40b": BASE | dict(vocab_size=65024, hidden_size=8192, intermediate_size=4 * 8192, num_hidden_layers=60,
                                  num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=2048,
                                  block_form="parallel_two_norms"),
        "falcon-tiny": BASE | dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                                   bos_token_id=None, eos_token_id=None),
    })
