"""MPT (MosaicML): ALiBi (``models/alibi.py``; transformers applies it with the bias maximum 8
whatever ``attn_config`` says, so other settings are refused), q|k|v fused in ``Wqkv`` and
clamped to ``clip_qkv``, the attention scale ``softmax_scale``, no biases, LayerNorms without
bias, a plain exact-GELU MLP 4 x ``d_model`` wide, a tied output head.

transformers builds neither ``learned_pos_emb``'s table nor ``embedding_fraction``'s gradient
trick (a forward unchanged); ``attn_config``'s other options (multi-query, qk LayerNorms, prefix
LM, sequence ids) and ``expansion_ratio``, ``no_bias``, ``logit_scale`` it does not read, so any
value but its default is refused, naming it.
"""

from __future__ import annotations

from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, special_tokens

PREFIX = "transformer."
# MptConfig's fields and defaults (transformers 5.25); attn_config's in ATTN
SCHEMA = dict(d_model=2048, n_heads=16, n_layers=24, expansion_ratio=4, max_seq_len=2048, vocab_size=50368,
              resid_pdrop=0.0, layer_norm_epsilon=1e-5, emb_pdrop=0.0, learned_pos_emb=True, attn_config=None,
              init_device="cpu", logit_scale=None, no_bias=True, embedding_fraction=1.0,
              norm_type="low_precision_layernorm", use_cache=False, initializer_range=0.02, tie_word_embeddings=True,
              pad_token_id=None, bos_token_id=None, eos_token_id=None)
ATTN = dict(attn_type="multihead_attention", attn_pdrop=0, attn_impl="torch", clip_qkv=None, softmax_scale=None,
            prefix_lm=False, qk_ln=False, attn_uses_sequence_id=False, alibi=True, alibi_bias_max=8)
ALIASES = {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers"}
FEATURES = frozenset({"alibi", "clip_qkv", "layernorm_no_bias", "pre_norms", "plain_mlp", "multipliers"})


def from_hf(hf: HFConfig) -> dict:
    hf.unalias(ALIASES)
    # the last three: a table and an init transformers does not build, float32 LayerNorm math
    hf.ignore(*INERT, "emb_pdrop", "init_device", "learned_pos_emb", "embedding_fraction", "norm_type")
    attn = dict(ATTN) | dict(hf.get("attn_config") or {})
    for key, value in attn.items():
        if key not in ("attn_pdrop", "attn_impl", "clip_qkv", "softmax_scale") and value != ATTN.get(key, value):
            raise hf.refuse("attn_config", f"{key}={value!r} is not what transformers' MPT computes "
                                           f"(only {key}={ATTN[key]!r})")
    d = hf.get("d_model")
    return dict(vocab_size=hf.get("vocab_size"), hidden_size=d, intermediate_size=4 * d,
                num_hidden_layers=hf.get("n_layers"), num_attention_heads=hf.get("n_heads"),
                max_position_embeddings=hf.get("max_seq_len"), rms_norm_eps=hf.get("layer_norm_epsilon"),
                hidden_act="gelu", mlp_type="plain", position_embedding="alibi", norm_type="layernorm_no_bias",
                clip_qkv=attn["clip_qkv"] or None, attention_multiplier=attn["softmax_scale"],
                tie_word_embeddings=hf.get("tie_word_embeddings"), initializer_range=hf.get("initializer_range"),
                **special_tokens(hf))


def to_hf(a) -> dict:
    return dict(d_model=a.hidden_size, n_heads=a.num_attention_heads, n_layers=a.num_hidden_layers,
                expansion_ratio=a.intermediate_size // a.hidden_size, max_seq_len=a.max_position_embeddings,
                layer_norm_epsilon=a.rms_norm_eps,
                attn_config=ATTN | dict(clip_qkv=a.clip_qkv, softmax_scale=a.attention_multiplier))


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), PREFIX + "wte.weight"), Weight(("final_norm", "scale"), PREFIX + "norm_f.weight")]
    return out if a.tie_word_embeddings else out + [Weight(("lm_head", "kernel"), "lm_head.weight", "linear")]


def layer_weights(a, spec) -> list[Weight]:
    h = PREFIX + "blocks.{i}."
    out = [Weight(("attn_norm", "scale"), h + "norm_1.weight"), Weight(("mlp_norm", "scale"), h + "norm_2.weight")]
    out += [Weight(("attn", n, "kernel"), h + "attn.Wqkv.weight", "linear", part=(j, 3)) for j, n in enumerate("qkv")]
    return out + [Weight(("attn", "o", "kernel"), h + "attn.out_proj.weight", "linear", n_in=2),
                  Weight(("mlp", "up", "kernel"), h + "ffn.up_proj.weight", "linear"),
                  Weight(("mlp", "down", "kernel"), h + "ffn.down_proj.weight", "linear")]


BASE = dict(position_embedding="alibi", norm_type="layernorm_no_bias", mlp_type="plain", hidden_act="gelu",
            rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
MPT = Family(
    "mpt", ("mpt",), "MptForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    presets={
        # mosaicml/mpt-7b/config.json
        "mpt-7b": BASE | dict(vocab_size=50432, hidden_size=4096, intermediate_size=16384, num_hidden_layers=32,
                              num_attention_heads=32, max_position_embeddings=2048),
        "mpt-tiny": BASE | dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=4, max_position_embeddings=256, clip_qkv=6.0),
    })
