"""GLM (GLM-4-9B-chat-hf) and GLM-4 (GLM-4-0414): Llama's model with q/k/v biases, rotary
embeddings on the first ``partial_rotary_factor`` of each head (0.5 when config.json names
none) turning interleaved pairs (2i, 2i + 1), and the gate and up projections fused in one
``mlp.gate_up_proj`` (gate | up rows, split on import and joined on export, as Phi-3's).

GLM-4 adds a norm after attention and one after the MLP (``post_self_attn_layernorm``,
``post_mlp_layernorm``): x + norm(attn(norm(x))), the sandwich norms of Gemma 2; its
``post_attention_layernorm`` is the MLP's input norm, as in GLM.

transformers' defaults differ from Llama's: ``num_key_value_heads`` 2 and ``head_dim`` 128 when
config.json has none, and an ``eos_token_id`` of three ids when it names none (null stays null
here: only generation's stop differs, and export writes it explicitly). The pad id, which
transformers defaults to 151329, is written as the first end-of-sequence id (the published
configs' choice), so that a small vocabulary holds it.
"""

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

GLM_EOS = [151329, 151336, 151338]
# GlmConfig's fields and transformers' defaults (Glm4Config has the same)
SCHEMA = dict(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
              num_attention_heads=32, num_key_value_heads=2, head_dim=128, hidden_act="silu",
              attention_dropout=0.0, max_position_embeddings=131072, initializer_range=0.02,
              rms_norm_eps=1.5625e-07, use_cache=True, tie_word_embeddings=False, rope_parameters=None,
              pad_token_id=151329, eos_token_id=GLM_EOS, bos_token_id=None, attention_bias=True)
FEATURES = llama.ROTARY | {"partial_rotary", "rope_interleaved", "attention_bias"}
FEATURES4 = (FEATURES - {"pre_norms"}) | {"sandwich_norms"}


# ------------------------------------------------------------------------------ config.json
def glm_rope(hf: HFConfig) -> dict:
    """``rope`` with GLM's default ``partial_rotary_factor`` 0.5 (transformers' for all three
    GLM families), where neither ``rope_parameters`` nor the top level names one."""
    out = rope(hf)
    named = "partial_rotary_factor" in (hf.get("rope_parameters") or {}) or "partial_rotary_factor" in hf
    return out if named else out | dict(partial_rotary_factor=0.5)


def glm_sizes(hf: HFConfig) -> dict:
    """``sizes`` with the family's own defaults of ``num_key_value_heads`` (and ``head_dim``
    where its config class has one)."""
    hf.ignore(*INERT)
    out = sizes(hf) | dict(num_key_value_heads=hf.get("num_key_value_heads"))
    if "head_dim" in hf.family.schema:
        out["head_dim"] = hf.get("head_dim")
    return out | glm_rope(hf)


def glm_sizes_to_hf(a) -> dict:
    eos = a.eos_token_id[0] if isinstance(a.eos_token_id, tuple) else a.eos_token_id
    return sizes_to_hf(a) | rope_to_hf(a) | dict(partial_rotary_factor=a.partial_rotary_factor, pad_token_id=eos)


def from_hf(hf: HFConfig) -> dict:
    return glm_sizes(hf) | dict(rope_interleaved=True, attention_bias=hf.get("attention_bias"))  # q/k/v only


def to_hf(a) -> dict:
    return glm_sizes_to_hf(a) | dict(attention_bias=a.attention_bias)


def glm4_from_hf(hf: HFConfig) -> dict:
    return from_hf(hf) | dict(norm_position="both")


# --------------------------------------------------------------------------------- weights
def layer_weights(a, spec) -> list[Weight]:
    """Llama's attention tensors; GLM-4's two post-norms; gate | up fused."""
    h = llama.LAYER
    norms = [("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")]
    if a.norm_position == "both":
        norms += [("post_attn_norm", "post_self_attn_layernorm"), ("post_mlp_norm", "post_mlp_layernorm")]
    out = [Weight((norm, "scale"), h + f"{name}.weight") for norm, name in norms]
    out += [w for w in llama.attention_weights(a) if w.path[0] == "attn"]
    out += [Weight(("mlp", n, "kernel"), h + "mlp.gate_up_proj.weight", "linear", part=(j, 2))
            for j, n in enumerate(("gate", "up"))]
    return out + [Weight(("mlp", "down", "kernel"), h + "mlp.down_proj.weight", "linear")]


# --------------------------------------------------------------------------------- presets
BASE = dict(partial_rotary_factor=0.5, rope_interleaved=True, attention_bias=True)
TINY = BASE | llama.TINY
GLM = Family(
    "glm", ("glm",), "GlmForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, llama.global_weights, layer_weights,
    presets={"glm-tiny": TINY})
GLM4 = Family(
    "glm4", ("glm4",), "Glm4ForCausalLM", SCHEMA, FEATURES4, glm4_from_hf, to_hf, llama.global_weights,
    layer_weights, presets={"glm4-tiny": TINY | dict(norm_position="both")})
