"""GPT-2: learned positions, LayerNorm, a plain GELU MLP, biases everywhere, fused q|k|v.

Its ``Conv1D`` weights are stored (in, out), and q, k and v are one ``c_attn`` tensor whose
column blocks the import splits and the export joins. Files from the Hub lack the
``transformer.`` prefix; the reader resolves either.
"""

from __future__ import annotations

from shardzoo.models.hf.base import (
    GEMMA_ONLY_OFF,
    Family,
    HFError,
    Weight,
    mismatches,
    special_tokens,
)
from shardzoo.models.transformer import TransformerConfig

PREFIX = "transformer."


def from_hf(hf: dict, where: str) -> dict:
    needed = (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
              ("add_cross_attention", False))
    bad = [k for k, ok in needed if hf.get(k, ok) != ok]
    if bad:
        raise HFError(f"{where}: GPT-2 option {', '.join(bad)} is not supported")
    d = hf.get("n_embd", 768)
    return dict(
        vocab_size=hf.get("vocab_size", 50257), hidden_size=d,
        intermediate_size=hf.get("n_inner") or 4 * d, num_hidden_layers=hf.get("n_layer", 12),
        num_attention_heads=hf.get("n_head", 12), num_key_value_heads=None,
        max_position_embeddings=hf.get("n_positions", 1024),
        rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        hidden_act=hf.get("activation_function", "gelu_new"), mlp_type="plain",
        position_embedding="learned", norm_type="layernorm", attention_bias=True,
        attention_out_bias=True, mlp_bias=True,
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        initializer_range=hf.get("initializer_range", 0.02), **special_tokens(hf),
    )


def to_hf(c) -> dict:
    return dict(n_embd=c.hidden_size, n_inner=c.intermediate_size, n_layer=c.num_hidden_layers,
                n_head=c.num_attention_heads, n_positions=c.max_position_embeddings,
                n_ctx=c.max_position_embeddings, layer_norm_epsilon=c.rms_norm_eps,
                activation_function=c.hidden_act)


def obstacles(c) -> list[str]:
    bad = mismatches(c, dict(position_embedding="learned", norm_type="layernorm",
                             mlp_type="plain", attention_bias=True, attention_out_bias=True,
                             mlp_bias=True, num_local_experts=0, sliding_window=None,
                             **GEMMA_ONLY_OFF))
    if c.kv_heads != c.num_attention_heads or c.head_size * c.num_attention_heads != c.hidden_size:
        bad.append("grouped or resized heads")
    return bad


def weights(c):
    """(global, dense layer, MoE layer) weights; GPT-2 has no MoE layer."""
    glob = [Weight(("embed", "embedding"), PREFIX + "wte.weight"),
            Weight(("pos_embed", "embedding"), PREFIX + "wpe.weight"),
            Weight(("final_norm", "scale"), PREFIX + "ln_f.weight"),
            Weight(("final_norm", "bias"), PREFIX + "ln_f.bias")]
    if not c.tie_word_embeddings:
        glob.append(Weight(("lm_head", "kernel"), "lm_head.weight", "linear"))
    h = PREFIX + "h.{i}."
    layer = [Weight((norm, leaf), f"{h}{ln}.{name}")
             for norm, ln in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2"))
             for leaf, name in (("scale", "weight"), ("bias", "bias"))]
    for j, n in enumerate("qkv"):
        layer += [Weight(("attn", n, "kernel"), h + "attn.c_attn.weight", "conv1d", part=(j, 3)),
                  Weight(("attn", n, "bias"), h + "attn.c_attn.bias", "vec", part=(j, 3))]
    layer += [Weight(("attn", "o", "kernel"), h + "attn.c_proj.weight", "conv1d", n_in=2),
              Weight(("attn", "o", "bias"), h + "attn.c_proj.bias", "vec"),
              Weight(("mlp", "up", "kernel"), h + "mlp.c_fc.weight", "conv1d"),
              Weight(("mlp", "up", "bias"), h + "mlp.c_fc.bias", "vec"),
              Weight(("mlp", "down", "kernel"), h + "mlp.c_proj.weight", "conv1d"),
              Weight(("mlp", "down", "bias"), h + "mlp.c_proj.bias", "vec")]
    return glob, layer, []


GPT2 = Family("gpt2", ("gpt2",), "GPT2LMHeadModel", TransformerConfig,
              from_hf, to_hf, obstacles, weights)
