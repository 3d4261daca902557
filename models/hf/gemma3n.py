"""Gemma 3n (text, ``gemma3n_text``; the text model of the multimodal ``gemma3n``): Gemma 3's
layers (four norms a block, qk-norm, sliding and full layers, GeGLU, scaled embeddings, a tied
head, soft-capped logits) with plain RMSNorms, values RMS-normalised without a weight, an
attention scale of 1, and the mechanisms of models/per_layer.py: per-layer input embeddings,
KV sharing (``num_kv_shared_layers``), AltUp streams, a Laurel branch and activation sparsity.
Its layers are unrolled (not scanned).
"""

from __future__ import annotations

from shardzoo.models.arch import FULL, SLIDING
from shardzoo.models.hf import gemma, llama
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    HFError,
    Weight,
    layer_types,
    rope,
    sizes,
)

SCHEMA = dict(
    vocab_size=262400, hidden_size=2048, intermediate_size=16384, num_hidden_layers=35, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768,
    initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    tie_word_embeddings=True, rope_parameters=None, attention_bias=False, attention_dropout=0.0, sliding_window=512,
    layer_types=None, final_logit_softcapping=30.0, vocab_size_per_layer_input=262144,
    hidden_size_per_layer_input=256, altup_active_idx=0, altup_coef_clip=120.0, altup_correct_scale=True,
    altup_num_inputs=4, num_kv_shared_layers=15, laurel_rank=64, activation_sparsity_pattern=None)
FEATURES = frozenset({"rope", "local_rope", "rmsnorm", "sandwich_norms", "gated_mlp", "qk_norm_head", "v_norm",
                      "scale_embeddings", "attention_bias", "attention_out_bias", "sliding_window", "layer_pattern",
                      "final_softcap", "multipliers", "gemma3n_layers", "per_layer_inputs", "kv_sharing", "altup",
                      "laurel", "activation_sparsity"})


# ------------------------------------------------------------------------------ config.json
def _width(hf: HFConfig) -> int:
    """One ``intermediate_size`` (a list of one value per layer, as transformers writes it)."""
    width = hf.get("intermediate_size")
    if isinstance(width, list):
        if len(set(width)) != 1:
            raise hf.refuse("intermediate_size", "layers of different MLP widths are not supported (one width)")
        width = width[0]
    return width


def _rope(hf: HFConfig) -> dict:
    params = hf.get("rope_parameters") or {}
    glob = rope(hf, params.get(FULL) or {}, theta=1e6)
    local = rope(hf, params.get(SLIDING) or {}, theta=1e4)
    if local["rope_scaling"]:
        raise HFError(f"{hf.where}: rope scaling of the {SLIDING} layers is not supported; only the global layers'")
    return dict(rope_theta=glob["rope_theta"], rope_scaling=glob["rope_scaling"],
                rope_local_base_freq=local["rope_theta"])


def gemma3n_from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT)
    n = hf.get("num_hidden_layers")
    types = tuple(hf.get("layer_types") or [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(n)])
    sparsity = hf.get("activation_sparsity_pattern")
    if sparsity is None:  # transformers' default
        sparsity = [0.95] * 10 + [0.0] * (n - 10) if n > 10 else [0.0] * n
    if hf.get("altup_active_idx") != 0:
        raise hf.refuse("altup_active_idx", "shardzoo runs AltUp's stream 0 as the active one")
    bias = hf.get("attention_bias")
    return sizes(hf) | _rope(hf) | dict(
        intermediate_size=_width(hf), hidden_act=hf.get("hidden_activation"), norm_type="rmsnorm",
        norm_position="both", qk_norm="head", v_norm=True, scale_embeddings=True, attention_multiplier=1.0,
        attention_bias=bias, attention_out_bias=bias, final_logit_softcapping=hf.get("final_logit_softcapping"),
        sliding_window=hf.get("sliding_window"), layer_types=types,
        hidden_size_per_layer_input=hf.get("hidden_size_per_layer_input"),
        vocab_size_per_layer_input=hf.get("vocab_size_per_layer_input"),
        num_kv_shared_layers=hf.get("num_kv_shared_layers"), altup_num_inputs=hf.get("altup_num_inputs"),
        altup_coef_clip=hf.get("altup_coef_clip"), altup_correct_scale=hf.get("altup_correct_scale"),
        laurel_rank=hf.get("laurel_rank"), activation_sparsity_pattern=tuple(float(s) for s in sparsity))


def gemma3n_to_hf(a) -> dict:
    out = llama.rotary_to_hf(a)
    for key in ("hidden_act", "rope_theta", "rope_scaling"):
        out.pop(key, None)
    p, n = a.per_layer, a.num_hidden_layers
    glob = {"rope_type": "default"} | {k: list(v) if isinstance(v, tuple) else v
                                        for k, v in a.rope_scaling_dict.items()} | {"rope_theta": a.rope_theta}
    local = {"rope_type": "default", "rope_theta": a.rope_local_base_freq or a.rope_theta}
    return out | dict(
        hidden_activation=a.hidden_act, attention_bias=a.attention_bias, sliding_window=a.sliding_window,
        layer_types=layer_types(a), final_logit_softcapping=a.final_logit_softcapping,
        rope_parameters={FULL: glob, SLIDING: local}, intermediate_size=[a.intermediate_size] * n,
        hidden_size_per_layer_input=p.input_size, vocab_size_per_layer_input=p.vocab_size or a.vocab_size,
        num_kv_shared_layers=p.kv_shared_layers, altup_num_inputs=p.altup_inputs, altup_active_idx=0,
        altup_coef_clip=p.altup_coef_clip, altup_correct_scale=p.altup_correct_scale, laurel_rank=p.laurel_rank,
        activation_sparsity_pattern=list(p.activation_sparsity or (0.0,) * n), pad_token_id=None)


# --------------------------------------------------------------------------------- weights
def global_weights(a) -> list[Weight]:
    """Llama's; with per-layer inputs the table, projection and norm, and AltUp's projections in
    and out (Gemma 4's small models too)."""
    m, out = "model.", llama.global_weights(a)
    if a.per_layer is None or not a.per_layer.input_size:
        return out
    out += [Weight(("per_layer_embed", "embedding"), m + "embed_tokens_per_layer.weight"),
            Weight(("per_layer_projection", "kernel"), m + "per_layer_model_projection.weight", "linear"),
            Weight(("per_layer_projection_norm", "scale"), m + "per_layer_projection_norm.weight")]
    for j in range(1, a.per_layer.altup_inputs):
        out += [Weight((f"altup_in_{j}", "kernel"), m + f"altup_projections.{j - 1}.weight", "linear"),
                Weight((f"altup_out_{j}", "kernel"), m + f"altup_unembed_projections.{j - 1}.weight", "linear")]
    return out


def per_layer_weights(a, spec, out: list[Weight]) -> list[Weight]:
    """A layer's tensors ``out`` as the per_layer record has them (Gemma 3n's, Gemma 4's): a
    KV-sharing layer's without k, v and k_norm; AltUp's, Laurel's and the per-layer input's added."""
    p, h = a.per_layer, llama.LAYER
    if p is None:
        return out
    out = [w for w in out if not (spec.shares_kv and w.path[:2] in (("attn", "k"), ("attn", "v"), ("attn", "k_norm")))]
    if p.input_size:
        out += [Weight(("per_layer_input", "gate", "kernel"), h + "per_layer_input_gate.weight", "linear"),
                Weight(("per_layer_input", "projection", "kernel"), h + "per_layer_projection.weight", "linear"),
                Weight(("per_layer_input", "norm", "scale"), h + "post_per_layer_input_norm.weight")]
    if p.laurel_rank:
        out += [Weight(("laurel", "left", "kernel"), h + "laurel.linear_left.weight", "linear"),
                Weight(("laurel", "right", "kernel"), h + "laurel.linear_right.weight", "linear"),
                Weight(("laurel", "norm", "scale"), h + "laurel.post_laurel_norm.weight")]
    if p.altup_inputs > 1:
        out += [Weight(("altup", "router", "kernel"), h + "altup.modality_router.weight", "linear"),
                Weight(("altup", "router_norm", "scale"), h + "altup.router_norm.weight"),
                Weight(("altup", "prediction", "kernel"), h + "altup.prediction_coefs.weight", "linear"),
                Weight(("altup", "correction", "kernel"), h + "altup.correction_coefs.weight", "linear"),
                Weight(("altup_scale",), h + "altup.correct_output_scale")]
    return out


def layer_weights(a, spec) -> list[Weight]:
    return per_layer_weights(a, spec, gemma.layer_weights(a, spec))


# --------------------------------------------------------------------------------- presets
def _gemma3n(n: int, **kw) -> dict:
    return dict(vocab_size=262400, head_dim=256, hidden_act="gelu_pytorch_tanh", norm_type="rmsnorm",
                norm_position="both", qk_norm="head", v_norm=True, scale_embeddings=True, attention_multiplier=1.0,
                tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, final_logit_softcapping=30.0,
                rope_theta=1000000.0, rope_local_base_freq=10000.0, max_position_embeddings=32768,
                num_hidden_layers=n, num_attention_heads=8, num_key_value_heads=2, sliding_window=512,
                layer_types=tuple(FULL if (i + 1) % 5 == 0 else SLIDING for i in range(n)),
                hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, altup_num_inputs=4,
                altup_coef_clip=120.0, altup_correct_scale=True, laurel_rank=64,
                activation_sparsity_pattern=(0.95,) * 10 + (0.0,) * (n - 10)) | kw


GEMMA3N = Family(
    "gemma3n_text", ("gemma3n_text",), "Gemma3nForCausalLM", SCHEMA, FEATURES, gemma3n_from_hf, gemma3n_to_hf,
    global_weights, layer_weights,
    presets={
        # google/gemma-3n-E2B's and E4B's text models (config.json text_config)
        "gemma-3n-e2b": _gemma3n(30, hidden_size=2048, intermediate_size=8192, num_kv_shared_layers=10),
        "gemma-3n-e4b": _gemma3n(35, hidden_size=2048, intermediate_size=16384, num_kv_shared_layers=15),
    })
