"""Cohere (Command R): attention and MLP side by side from one LayerNorm without bias (the
parallel residual), a gated SwiGLU MLP, rotary embeddings turning interleaved pairs of features
(``rope_interleaved``), tied embeddings, logits multiplied by ``logit_scale``, and optionally a
LayerNorm of each query and key head with a weight per head (``use_qk_norm``)."""

from __future__ import annotations

from shardzoo.models.hf import llama
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    Weight,
    rope,
    rope_to_hf,
    sizes,
    sizes_to_hf,
)

SCHEMA = dict(vocab_size=256000, hidden_size=8192, intermediate_size=22528, logit_scale=0.0625,
              num_hidden_layers=40, num_attention_heads=64, num_key_value_heads=None, hidden_act="silu",
              max_position_embeddings=8192, initializer_range=0.02, layer_norm_eps=1e-5, use_cache=True,
              pad_token_id=0, bos_token_id=5, eos_token_id=255001, tie_word_embeddings=True,
              rope_parameters=None, attention_bias=False, attention_dropout=0.0, use_qk_norm=False)
FEATURES = frozenset({"rope", "rope_scaling:linear", "rope_scaling:llama3", "rope_interleaved",
                      "layernorm_no_bias", "pre_norms", "parallel_residual", "gated_mlp", "attention_bias",
                      "attention_out_bias", "qk_norm_heads", "logit_scale"})


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    bias = hf.get("attention_bias")  # q/k/v and o
    out = sizes(hf, "layer_norm_eps") | rope(hf) | dict(
        norm_type="layernorm_no_bias", block_form="parallel", rope_interleaved=True,
        attention_bias=bias, attention_out_bias=bias, logit_scale=hf.get("logit_scale"),
        qk_norm="heads" if hf.get("use_qk_norm") else "none")
    out.pop("partial_rotary_factor")  # Cohere rotates whole heads
    return out


def to_hf(a) -> dict:
    out = sizes_to_hf(a) | rope_to_hf(a) | dict(
        layer_norm_eps=a.rms_norm_eps, logit_scale=a.logit_scale, attention_bias=a.attention_bias,
        use_qk_norm=a.qk_norm == "heads")
    del out["rms_norm_eps"]
    out.pop("partial_rotary_factor", None)
    if a.head_dim is None:
        del out["head_dim"]  # CohereConfig has none: hidden_size / heads
    return out


def layer_weights(a, spec) -> list[Weight]:
    h = llama.LAYER
    out = [Weight(("attn_norm", "scale"), h + "input_layernorm.weight")]
    for n in "qkvo":
        out.append(Weight(("attn", n, "kernel"), h + f"self_attn.{n}_proj.weight", "linear",
                          n_in=2 if n == "o" else 1))
        if a.attention_bias:
            out.append(Weight(("attn", n, "bias"), h + f"self_attn.{n}_proj.bias", "vec"))
    if a.qk_norm == "heads":  # [heads, head_dim] in HF too
        out += [Weight(("attn", f"{n}_norm", "scale"), h + f"self_attn.{n}_norm.weight") for n in "qk"]
    return out + llama.mlp_weights(a)


BASE = dict(norm_type="layernorm_no_bias", block_form="parallel", rope_interleaved=True, rms_norm_eps=1e-5,
            tie_word_embeddings=True, logit_scale=0.0625)
# CohereForAI/c4ai-command-r-v01/config.json
COMMAND_R = BASE | dict(vocab_size=256000, hidden_size=8192, intermediate_size=22528, num_hidden_layers=40,
                        num_attention_heads=64, max_position_embeddings=8192, rope_theta=8000000.0,
                        bos_token_id=5, eos_token_id=255001)
COHERE = Family(
    "cohere", ("cohere",), "CohereForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights,
    presets={"c4ai-command-r-v01": COMMAND_R,
             "cohere-tiny": BASE | llama.TINY | dict(qk_norm="heads")})
