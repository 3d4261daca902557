"""Hugging Face ``config.json`` <-> ``TransformerConfig`` (split from ``models/hf.py``).

Supported ``model_type``s: llama (Llama 2/3/3.1/3.2, rope_scaling llama3), mistral, qwen2 (2.5),
mixtral and gpt2. ``models/hf.py`` re-exports every name here.
"""

from __future__ import annotations

import json
import os

from shardzoo.errors import UserError

SUPPORTED = ("llama", "mistral", "qwen2", "mixtral", "gpt2")
# The zoo preset each family's imported config is recorded against (with every field overridden).
FAMILY_PRESETS = {"llama": "llama2-7b", "mistral": "mistral-7b", "qwen2": "qwen2.5-0.5b",
                  "mixtral": "mixtral-8x7b", "gpt2": "gpt2"}
ROPE_TYPES = ("default", "linear", "llama3")  # those models/layers.py's rope_inv_freq computes


class HFError(UserError):
    """An HF model directory shardzoo cannot read (or a config it cannot write as one)."""


# ------------------------------------------------------------------------------- config.json
def read_hf_config(hf_dir: str) -> dict:
    """The parsed ``config.json`` of an HF model directory."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise HFError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise HFError(f"{path}: cannot read: {e}") from None


def is_hf_dir(path) -> bool:
    """Whether ``path`` is an HF model directory: config.json with a model_type, and safetensors."""
    if not path or not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        return False
    try:
        with open(os.path.join(path, "config.json")) as f:
            has_type = "model_type" in json.load(f)
    except (OSError, ValueError):
        return False
    return has_type and any(n.endswith(".safetensors") for n in os.listdir(path))


def _rope(hf: dict, where: str) -> tuple[float, dict | None]:
    """rope_theta and rope_scaling from either transformers 5's ``rope_parameters`` or the
    older top-level ``rope_theta`` + ``rope_scaling``; ``None`` for plain rotary embeddings."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = dict(hf.get("rope_scaling") or params)
    scaling.pop("rope_theta", None)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return float(theta), None
    if kind not in ROPE_TYPES:
        raise HFError(f"{where}: rope_scaling type {kind!r} is not supported; "
                      f"supported: {', '.join(ROPE_TYPES)}")
    return float(theta), scaling


def _sliding_window(hf: dict, where: str) -> int | None:
    window = hf.get("sliding_window")
    if hf.get("model_type") == "qwen2" and not hf.get("use_sliding_window", False):
        window = None
    kinds = set(hf.get("layer_types") or ())
    if window and kinds == {"full_attention"}:
        window = None
    if window and len(kinds) > 1:
        raise HFError(f"{where}: layer_types mixes sliding and full attention; "
                      "shardzoo has one window for all layers")
    return window


def config_from_hf(hf: dict, where: str = "config.json") -> dict:
    """TransformerConfig fields (a dict) from an HF ``config.json``; names map one to one."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise HFError(
            f"{where}: unsupported model_type {kind!r}; supported: {', '.join(SUPPORTED)}"
        )
    special = {k: hf.get(k) for k in ("bos_token_id", "eos_token_id")}
    if isinstance(special["eos_token_id"], list):
        special["eos_token_id"] = tuple(special["eos_token_id"])
    if kind == "gpt2":
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
            initializer_range=hf.get("initializer_range", 0.02), **special,
        )
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in hf]
    if missing:
        raise HFError(f"{where}: no {', '.join(missing)}")
    theta, scaling = _rope(hf, where)
    fields = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads"), head_dim=hf.get("head_dim"),
        max_position_embeddings=hf.get("max_position_embeddings", 2048), rope_theta=theta,
        rope_scaling=scaling, partial_rotary_factor=hf.get("partial_rotary_factor", 1.0),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), sliding_window=_sliding_window(hf, where),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        hidden_act=hf.get("hidden_act", "silu"),
        initializer_range=hf.get("initializer_range", 0.02), attention_bias=False,
        attention_out_bias=False, mlp_bias=False, **special,
    )
    if kind == "llama":  # one flag for q/k/v and o biases
        bias = hf.get("attention_bias", False)
        fields.update(attention_bias=bias, attention_out_bias=bias,
                      mlp_bias=hf.get("mlp_bias", False))
    elif kind == "qwen2":  # q/k/v biases, no o bias
        fields.update(attention_bias=True)
    elif kind == "mixtral":  # every layer MoE; no z-loss in HF's Mixtral; dropless = HF's routing
        fields.update(
            num_local_experts=hf.get("num_local_experts", 8),
            num_experts_per_tok=hf.get("num_experts_per_tok", 2),
            router_jitter_noise=hf.get("router_jitter_noise", 0.0),
            router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001), router_z_loss_coef=0.0,
            moe_dispatch="dropless", norm_topk_prob=True,
        )
    return fields


def _hf_model_type(config) -> str:
    """The HF family that expresses ``config`` exactly; an HFError naming the obstacle if none."""
    c = config
    if c.position_embedding == "learned":
        need = dict(norm_type="layernorm", mlp_type="plain", attention_bias=True,
                    attention_out_bias=True, mlp_bias=True, num_local_experts=0)
        bad = [f"{k}={getattr(c, k)!r}" for k, v in need.items() if getattr(c, k) != v]
        heads = c.num_attention_heads
        if c.kv_heads != heads or c.head_size * heads != c.hidden_size:
            bad.append("grouped or resized heads")
        if bad:
            raise HFError(f"learned positions export as gpt2, which cannot express "
                          f"{', '.join(bad)}")
        return "gpt2"
    bad = [f"{k}={getattr(c, k)!r}" for k, v in (("norm_type", "rmsnorm"), ("mlp_type", "gated"))
           if getattr(c, k) != v]
    if bad:
        raise HFError(f"rotary models export as llama/mistral/qwen2/mixtral, which need "
                      f"{', '.join(bad)}")
    if c.num_local_experts:
        need = dict(moe_layer_freq=1, norm_topk_prob=True, attention_bias=False,
                    attention_out_bias=False)
        bad = [f"{k}={getattr(c, k)!r}" for k, v in need.items() if getattr(c, k) != v]
        if bad:
            raise HFError(f"MoE models export as mixtral, which needs {', '.join(bad)}")
        return "mixtral"
    if c.attention_bias and not c.attention_out_bias and not c.mlp_bias:
        return "qwen2"
    if c.attention_bias != c.attention_out_bias:
        raise HFError("attention_out_bias differs from attention_bias: no HF family expresses that")
    if c.sliding_window and not (c.attention_bias or c.mlp_bias):
        return "mistral"
    if c.sliding_window:
        raise HFError("sliding_window with biases: no HF family expresses that")
    return "llama"


def config_to_hf(config, dtype: str | None = None) -> dict:
    """An HF ``config.json`` dict for ``config`` (legacy rope keys: transformers 4 and 5 read them).
    """
    c, kind = config, _hf_model_type(config)
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM",
            "gpt2": "GPT2LMHeadModel"}[kind]
    eos = list(c.eos_token_id) if isinstance(c.eos_token_id, tuple) else c.eos_token_id
    out = dict(architectures=[arch], model_type=kind, vocab_size=c.vocab_size,
               bos_token_id=c.bos_token_id, eos_token_id=eos,
               tie_word_embeddings=c.tie_word_embeddings, initializer_range=c.initializer_range,
               torch_dtype=dtype or c.param_dtype)
    if kind == "gpt2":
        return out | dict(n_embd=c.hidden_size, n_inner=c.intermediate_size,
                          n_layer=c.num_hidden_layers, n_head=c.num_attention_heads,
                          n_positions=c.max_position_embeddings, n_ctx=c.max_position_embeddings,
                          layer_norm_epsilon=c.rms_norm_eps, activation_function=c.hidden_act)
    out |= dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.kv_heads, head_dim=c.head_size,
                max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
                rope_scaling=c.rope_scaling_dict or None, rms_norm_eps=c.rms_norm_eps,
                hidden_act=c.hidden_act, sliding_window=c.sliding_window)
    if c.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = c.partial_rotary_factor
    if kind == "llama":
        out |= dict(attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)
    elif kind == "qwen2":
        out |= dict(use_sliding_window=bool(c.sliding_window), max_window_layers=0)
    elif kind == "mixtral":
        out |= dict(num_local_experts=c.num_local_experts,
                    num_experts_per_tok=c.num_experts_per_tok,
                    router_jitter_noise=c.router_jitter_noise,
                    router_aux_loss_coef=c.router_aux_loss_coef)
    return out


def load_hf_config(hf_dir: str, dtype=None, scan_layers: bool = True, overrides=None):
    """The TransformerConfig of an HF model directory.

    ``dtype`` ("float32" | "bfloat16") sets both the parameter and the compute dtype (default
    float32); ``overrides`` are further TransformerConfig fields (e.g. ``moe_dispatch``).
    """
    from shardzoo.models import apply_overrides
    from shardzoo.models.transformer import TransformerConfig

    fields = config_from_hf(read_hf_config(hf_dir), where=os.path.join(hf_dir, "config.json"))
    fields["scan_layers"] = scan_layers
    if dtype is not None:
        fields.update(dtype=str(dtype), param_dtype=str(dtype))
    return apply_overrides(TransformerConfig(**fields), dict(overrides or {}), where=hf_dir)
