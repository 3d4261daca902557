"""GPT-2: learned positions, LayerNorm, a plain GELU MLP, biases everywhere, fused q|k|v.

Its ``Conv1D`` weights are stored (in, out), and q, k and v are one ``c_attn`` tensor whose
column blocks the import splits and the export joins. Files from the Hub lack the
``transformer.`` prefix; the reader resolves either. GPT-2's options that change the model
(``scale_attn_by_inverse_layer_idx``, ``add_cross_attention``, ...) are not read, so any value
but transformers' default is refused by the generic check.
"""

from __future__ import annotations

from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, special_tokens

PREFIX = "transformer."
SCHEMA = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
              activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
              layer_norm_epsilon=1e-5, initializer_range=0.02, summary_type="cls_index",
              summary_use_proj=True, summary_activation=None, summary_proj_to_labels=True,
              summary_first_dropout=0.1, scale_attn_weights=True, use_cache=True,
              scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
              add_cross_attention=False, bos_token_id=50256, eos_token_id=50256, pad_token_id=None,
              tie_word_embeddings=True)
FEATURES = frozenset({"learned_positions", "layernorm", "pre_norms", "plain_mlp", "attention_bias",
                      "attention_out_bias", "mlp_bias"})


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, "n_ctx", "reorder_and_upcast_attn")  # n_ctx: n_positions' alias; the last: float32 math
    d = hf.get("n_embd")
    return dict(
        vocab_size=hf.get("vocab_size"), hidden_size=d, intermediate_size=hf.get("n_inner") or 4 * d,
        num_hidden_layers=hf.get("n_layer"), num_attention_heads=hf.get("n_head"),
        max_position_embeddings=hf.get("n_positions"), rms_norm_eps=hf.get("layer_norm_epsilon"),
        hidden_act=hf.get("activation_function"), mlp_type="plain", position_embedding="learned",
        norm_type="layernorm", attention_bias=True, attention_out_bias=True, mlp_bias=True,
        tie_word_embeddings=hf.get("tie_word_embeddings"), initializer_range=hf.get("initializer_range"),
        **special_tokens(hf))


def to_hf(a) -> dict:
    return dict(n_embd=a.hidden_size, n_inner=a.intermediate_size, n_layer=a.num_hidden_layers,
                n_head=a.num_attention_heads, n_positions=a.max_position_embeddings,
                n_ctx=a.max_position_embeddings, layer_norm_epsilon=a.rms_norm_eps,
                activation_function=a.hidden_act)


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), PREFIX + "wte.weight"),
           Weight(("pos_embed", "embedding"), PREFIX + "wpe.weight"),
           Weight(("final_norm", "scale"), PREFIX + "ln_f.weight"),
           Weight(("final_norm", "bias"), PREFIX + "ln_f.bias")]
    if not a.tie_word_embeddings:
        out.append(Weight(("lm_head", "kernel"), "lm_head.weight", "linear"))
    return out


def layer_weights(a, spec) -> list[Weight]:
    h = PREFIX + "h.{i}."
    layer = [Weight((norm, leaf), f"{h}{ln}.{name}")
             for norm, ln in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2"))
             for leaf, name in (("scale", "weight"), ("bias", "bias"))]
    for j, n in enumerate("qkv"):
        layer += [Weight(("attn", n, "kernel"), h + "attn.c_attn.weight", "conv1d", part=(j, 3)),
                  Weight(("attn", n, "bias"), h + "attn.c_attn.bias", "vec", part=(j, 3))]
    return layer + [Weight(("attn", "o", "kernel"), h + "attn.c_proj.weight", "conv1d", n_in=2),
                    Weight(("attn", "o", "bias"), h + "attn.c_proj.bias", "vec"),
                    Weight(("mlp", "up", "kernel"), h + "mlp.c_fc.weight", "conv1d"),
                    Weight(("mlp", "up", "bias"), h + "mlp.c_fc.bias", "vec"),
                    Weight(("mlp", "down", "kernel"), h + "mlp.c_proj.weight", "conv1d"),
                    Weight(("mlp", "down", "bias"), h + "mlp.c_proj.bias", "vec")]


BASE = dict(vocab_size=50257, max_position_embeddings=1024, rms_norm_eps=1e-5, attention_bias=True,
            attention_out_bias=True, mlp_bias=True, tie_word_embeddings=True, hidden_act="gelu_new",
            mlp_type="plain", position_embedding="learned", norm_type="layernorm",
            bos_token_id=50256, eos_token_id=50256)
GPT2 = Family(
    "gpt2", ("gpt2",), "GPT2LMHeadModel", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    presets={
        "gpt2": BASE | dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
        "gpt2-medium": BASE | dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                   num_attention_heads=16),
        "gpt2-tiny": BASE | dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=256, bos_token_id=None,
                                 eos_token_id=None),
    })
