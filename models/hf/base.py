"""What every Hugging Face family module uses: the ``Family`` and ``Weight`` records, reading
``config.json``, and the config.json fields several families share (rope, window, special ids).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

from shardzoo.errors import UserError

ROPE_TYPES = ("default", "linear", "llama3")  # those models/layers.py's rope_inv_freq computes


class HFError(UserError):
    """An HF model directory shardzoo cannot read (or a config it cannot write as one)."""


@dataclasses.dataclass(frozen=True)
class Weight:
    """One shardzoo leaf and the HF tensor(s) it is made of.

    ``op``: "copy" (same shape), "vec" (a bias, flat in HF), "linear" (HF ``nn.Linear`` (out, in))
    or "conv1d" (GPT-2 ``Conv1D`` (in, out)); the leaf's first ``n_in`` dims are the inputs.
    ``part`` (j, n): the leaf is the j-th of n column blocks of a fused tensor (GPT-2's c_attn,
    Phi-3's qkv_proj and gate_up_proj); ``widths``: the n blocks' relative widths where they
    differ (Phi-3's q|k|v under GQA: heads, kv_heads, kv_heads), else equal.
    ``experts``: ``{e}`` in the name runs over experts, stacked on the leaf's first axis.
    Names hold ``{i}`` for the layer.
    """

    path: tuple[str, ...]
    name: str
    op: str = "copy"
    n_in: int = 1
    part: tuple[int, int] = (0, 1)
    widths: tuple[int, ...] = ()
    experts: int = 0


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face model family, declared whole in its own module.

    ``name`` is what a checkpoint records; ``model_types`` the config.json values it reads.
    ``from_hf(hf, where)``: config.json (a dict) -> fields of ``config_class``.
    ``to_hf(config)``: the family's own config.json keys (the registry adds the shared ones).
    ``obstacles(config)``: what in ``config`` this family cannot express (empty: it can).
    ``weights(config)``: (global weights, weights of a dense layer, weights of a MoE layer).
    """

    name: str
    model_types: tuple[str, ...]
    architecture: str
    config_class: type
    from_hf: Callable[[dict, str], dict]
    to_hf: Callable[[object], dict]
    obstacles: Callable[[object], list[str]]
    weights: Callable[[object], tuple[list[Weight], list[Weight], list[Weight]]]


# TransformerConfig fields only the Gemma families (gemma.py) express, at their off values:
# what every other family needs.
GEMMA_ONLY_OFF = dict(scale_embeddings=False, query_pre_attn_scalar=None,
                      attn_logit_softcapping=None, final_logit_softcapping=None,
                      sliding_window_pattern=None, rope_local_base_freq=None)


def mismatches(config, need: dict) -> list[str]:
    """``field=value`` for each field of ``config`` that differs from ``need``."""
    return [f"{k}={getattr(config, k)!r}" for k, v in need.items() if getattr(config, k) != v]


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


def special_tokens(hf: dict) -> dict:
    """bos_token_id and eos_token_id (a list of eos ids becomes a tuple)."""
    special = {k: hf.get(k) for k in ("bos_token_id", "eos_token_id")}
    if isinstance(special["eos_token_id"], list):
        special["eos_token_id"] = tuple(special["eos_token_id"])
    return special


def rope(hf: dict, where: str) -> tuple[float, dict | None]:
    """rope_theta and rope_scaling from either transformers 5's ``rope_parameters`` or the
    older top-level ``rope_theta`` + ``rope_scaling``; ``None`` for plain rotary embeddings."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = dict(hf.get("rope_scaling") or params)
    scaling.pop("rope_theta", None)
    scaling.pop("partial_rotary_factor", None)  # not a scaling: see partial_rotary_factor()
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return float(theta), None
    if kind not in ROPE_TYPES:
        raise HFError(f"{where}: rope_scaling type {kind!r} is not supported; "
                      f"supported: {', '.join(ROPE_TYPES)}")
    return float(theta), scaling


def partial_rotary_factor(hf: dict) -> float:
    """The rotated fraction of each head: top-level, or inside transformers 5's ``rope_parameters``."""
    params = hf.get("rope_parameters") or {}
    return float(hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)))


def sliding_window(hf: dict, where: str, enabled: bool = True) -> int | None:
    """The attention window of every layer (None: full attention); ``enabled`` False for a
    family whose flag turned the window off (Qwen2's ``use_sliding_window``)."""
    window = hf.get("sliding_window") if enabled else None
    kinds = set(hf.get("layer_types") or ())
    if window and kinds == {"full_attention"}:
        window = None
    if window and len(kinds) > 1:
        raise HFError(f"{where}: layer_types mixes sliding and full attention; "
                      "shardzoo has one window for all layers")
    return window
