"""What every Hugging Face family module uses: the ``Family`` and ``Weight`` records, the
``HFConfig`` reader of config.json, and the fields several families read alike.

A family declares its config.json ``schema``: every field transformers' config class has for
it, with transformers' default. Its ``from_hf`` reads fields through ``HFConfig``, which gives
the schema's default for a missing one and remembers what was read. The one generic check
(``HFConfig.finish``): a schema field that ``from_hf`` did not read must hold its default, else
the import is refused naming it; a field it reads with a value it cannot express is refused by
the reader, naming it too. Fields outside the schema are ones transformers ignores too.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping

from shardzoo.errors import UserError


class HFError(UserError):
    """An HF model directory shardzoo cannot read (or a config it cannot write as one)."""


@dataclasses.dataclass(frozen=True)
class Weight:
    """One shardzoo leaf and the HF tensor(s) it is made of.

    ``op``: "copy" (same shape), "vec" (a bias, flat in HF), "linear" (HF ``nn.Linear`` (out, in))
    or "conv1d" (GPT-2 ``Conv1D`` (in, out)), or "depthwise" (a depthwise ``nn.Conv1d``'s
    (channels, 1, width), the leaf (width, channels)); the leaf's first ``n_in`` dims are the inputs.
    ``part`` (j, n): the leaf is the j-th of n column blocks of a fused tensor (GPT-2's c_attn,
    Phi-3's qkv_proj and gate_up_proj); ``widths``: the n blocks' relative widths where they
    differ (Phi-3's q|k|v under GQA: heads, kv_heads, kv_heads), else equal.
    With ``interleaved`` the parts alternate column by column instead (equal widths).
    ``experts``: ``{e}`` in the name runs over experts, stacked on the leaf's first axis; with
    ``stacked_experts`` the HF tensor already holds every expert (``[expert, ...]``, no ``{e}``);
    with ``merged_experts`` too, merged into its first axis (``[expert * rows, cols]``: DBRX).
    Names hold ``{i}`` for the layer.
    """

    path: tuple[str, ...]
    name: str
    op: str = "copy"
    n_in: int = 1
    part: tuple[int, int] = (0, 1)
    widths: tuple[int, ...] = ()
    experts: int = 0
    stacked_experts: bool = False
    merged_experts: bool = False
    interleaved: bool = False  # the j-th of n parts is the columns j, j + n, ... (GPT-OSS's gate_up_proj)
    # the fused tensor's columns are ``groups`` equal blocks, each holding all n parts in turn
    # (Qwen3-Next's in_proj_qkvz: q, k, v, z of each key head); the leaf is its part of every block
    groups: int = 1
    hf_shape: tuple[int, ...] = ()  # a whole "vec": the HF tensor's shape where it is not flat (Kimi's A_log)
    # the leaf's last axis (one head's features) holds HF's two halves swapped: nanochat's q and k,
    # whose rotary turns the other way (R(-t) = S R(t) S for the swap S, which a weightless qk-norm
    # and q.k do not see), so shardzoo's rotary computes its model
    halves_swapped: bool = False
    # the fused tensor (``name``) stored as these tensors, one per part, joined on their first axis
    # however the file splits it (OLMo hybrid's q_conv1d | k_conv1d | v_conv1d: transformers saves
    # equal thirds); an export writes each part under its own
    pieces: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face model family, declared whole in its own module.

    ``name`` is what a checkpoint records; ``model_types`` the config.json values it reads.
    ``schema``: config.json field -> transformers' default, every field of the family's config
    class. ``features``: the architecture features it expresses (``models/features.py``).
    ``from_hf(hf: HFConfig) -> dict`` of architecture fields; ``to_hf(arch) -> dict`` of the
    family's config.json keys (the registry adds the shared ones). ``global_weights(arch)`` and
    ``layer_weights(arch, spec)``: the tensors of the model and of one layer (its
    ``LayerSpec``). ``execution``: execution fields an import sets so that the model computes
    as transformers does (its MoE drops no token). ``presets``: zoo models of this family,
    name -> architecture fields (and execution fields).
    """

    name: str
    model_types: tuple[str, ...]
    architecture: str
    schema: Mapping[str, object]
    features: frozenset
    from_hf: Callable
    to_hf: Callable
    global_weights: Callable
    layer_weights: Callable
    execution: Mapping[str, object] = dataclasses.field(default_factory=dict)
    presets: Mapping[str, dict] = dataclasses.field(default_factory=dict)


_MISSING = object()


class HFConfig:
    """A family's view of one config.json: ``get`` gives a field or its schema default and
    records it as read; ``finish`` refuses what was not read and is not at its default."""

    def __init__(self, raw: dict, family: Family, where: str):
        self.raw, self.family, self.where = raw, family, where
        self.read: set[str] = set()

    def __contains__(self, key) -> bool:
        return self.raw.get(key) is not None

    def get(self, key: str, default=_MISSING):
        """The field's value (an explicit null too), else ``default``, else the schema's default."""
        if key not in self.family.schema and default is _MISSING:
            raise KeyError(f"{self.family.name}: {key!r} is not in its schema")
        self.read.add(key)
        if key in self.raw:
            return self.raw[key]
        return self.family.schema.get(key) if default is _MISSING else default

    def require(self, *keys: str) -> None:
        """Fields without which the config says nothing (no default makes sense)."""
        missing = [k for k in keys if self.raw.get(k) is None]
        if missing:
            raise HFError(f"{self.where}: no {', '.join(missing)}")

    def unalias(self, aliases: dict) -> None:
        """Read each ``alias: name`` key under its schema name (published config.json files spell
        some fields by transformers' ``attribute_map`` or older names), where the name is absent."""
        for alias, name in aliases.items():
            if alias in self.raw and name not in self.raw:
                self.raw = {name if k == alias else k: v for k, v in self.raw.items()}

    def ignore(self, *keys: str) -> None:
        """Fields the family reads and that do not change the model's numbers."""
        self.read.update(keys)

    def refuse(self, key: str, why: str) -> HFError:
        return HFError(f"{self.where}: {key}={self.raw.get(key)!r}: {why}")

    def finish(self) -> None:
        """The generic check: a schema field not read must hold transformers' default."""
        for key, default in self.family.schema.items():
            if key in self.read or key not in self.raw:
                continue
            value = self.raw[key]
            if value != default and not (value in (None, False, 0) and default in (None, False, 0)):
                raise HFError(f"{self.where}: {key}={value!r} changes the model and shardzoo's "
                              f"{self.family.name} does not implement it (only {key}={default!r})")


# ------------------------------------------------------------------------------- config.json
def renamed(weights: list, names: tuple[tuple[str, str], ...]) -> list:
    """``weights`` with each ``(old, new)`` substring of their HF names replaced, in order: a family
    that stores another family's tensors under its own names."""
    out = []
    for w in weights:
        name = w.name
        for old, new in names:
            name = name.replace(old, new)
        out.append(dataclasses.replace(w, name=name))
    return out


def read_hf_config(hf_dir: str) -> dict:
    """The parsed ``config.json`` of an HF model directory; of a multimodal checkpoint, its text
    model's (multimodal.py), said once on stderr."""
    from shardzoo.models.hf import multimodal

    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise HFError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise HFError(f"{path}: cannot read: {e}") from None
    multimodal.note(hf_dir, hf)
    return multimodal.text_part(hf, path)


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


# ------------------------------------------------------------- fields several families share
# those models/rope.py's rope_frequencies computes
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic", "proportional")
# the types whose original_max_position_embeddings transformers defaults to max_position_embeddings
_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")
ROPE_KEYS = ("rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor")
# Fields of the decoder families' config classes that do not change the model's numbers; and
# dropout rates, which shardzoo does not apply (it trains without dropout, README says so).
INERT = ("use_cache", "pad_token_id", "pretraining_tp", "output_router_logits", "attention_dropout",
         "attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_first_dropout", "hidden_dropout",
         "summary_activation", "summary_proj_to_labels", "summary_type", "summary_use_proj")


def special_tokens(hf: HFConfig) -> dict:
    """bos_token_id and eos_token_id (a list of eos ids becomes a tuple)."""
    eos = hf.get("eos_token_id")
    return {"bos_token_id": hf.get("bos_token_id"),
            "eos_token_id": tuple(eos) if isinstance(eos, list) else eos}


def rope(hf: HFConfig, params: dict | None = None, theta: float = 10000.0, rotary: float = 1.0) -> dict:
    """``rope_theta``, ``rope_scaling`` and ``partial_rotary_factor`` from transformers 5's
    ``rope_parameters`` or the older top-level keys (``params``: a sub-dict of
    ``rope_parameters`` to read instead, e.g. Gemma 3's per layer kind; ``theta`` and ``rotary``:
    the family's default base and rotary fraction)."""
    if params is None:
        params = dict(hf.get("rope_parameters", None) or {})
    else:
        params = dict(params)
    theta = params.pop("rope_theta", None) or hf.get("rope_theta", None) or theta
    factor = params.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor", None) or rotary
    scaling = dict(hf.get("rope_scaling", None) or params)
    for key in ("rope_theta", "partial_rotary_factor"):
        scaling.pop(key, None)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    kind = scaling.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise HFError(f"{hf.where}: rope_scaling type {kind!r} is not supported; "
                      f"supported: {', '.join(ROPE_TYPES)}")
    if kind == "proportional":  # its fraction is of the angles, the whole head turning
        scaling["partial_rotary_factor"], factor = factor, 1.0
    if kind in _ORIGINAL_LENGTH and "max_position_embeddings" in hf.family.schema:
        scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return dict(rope_theta=float(theta), rope_scaling=None if kind == "default" else scaling,
                partial_rotary_factor=float(factor))


def rope_to_hf(arch) -> dict:
    """The legacy rope keys (transformers 4 and 5 read them)."""
    scaling = {k: list(v) if isinstance(v, tuple) else v for k, v in arch.rope_scaling_dict.items()}
    out = dict(rope_theta=arch.rope_theta, rope_scaling=scaling or None)  # longrope's factors as lists
    if arch.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = arch.partial_rotary_factor
    return out


def rope_parameters_to_hf(arch, partial: bool = False) -> dict:
    """transformers 5's ``rope_parameters`` (for the families whose config reads no top-level
    rotary key); ``partial``: with the rotated fraction."""
    scaling = {k: list(v) if isinstance(v, tuple) else v for k, v in arch.rope_scaling_dict.items()}
    out = {"rope_type": "default", **scaling, "rope_theta": arch.rope_theta}
    return out | ({"partial_rotary_factor": arch.partial_rotary_factor} if partial else {})


def sizes(hf: HFConfig, eps: str | float = "rms_norm_eps") -> dict:
    """The sizes every rotary decoder family spells alike (``eps``: the family's name of the
    norms' epsilon, or its value where config.json has none)."""
    hf.require("hidden_size", "num_hidden_layers", "num_attention_heads")
    heads = hf.get("num_attention_heads")
    return dict(vocab_size=hf.get("vocab_size"), hidden_size=hf.get("hidden_size"),
                intermediate_size=hf.get("intermediate_size"), num_hidden_layers=hf.get("num_hidden_layers"),
                num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads", heads),
                head_dim=hf.get("head_dim", None), max_position_embeddings=hf.get("max_position_embeddings"),
                rms_norm_eps=hf.get(eps) if isinstance(eps, str) else eps, initializer_range=hf.get("initializer_range"),
                hidden_act=hf.get("hidden_act") if "hidden_act" in hf.family.schema else None,
                tie_word_embeddings=hf.get("tie_word_embeddings"),
                **special_tokens(hf))


def sizes_to_hf(arch) -> dict:
    return dict(hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
                num_hidden_layers=arch.num_hidden_layers, num_attention_heads=arch.num_attention_heads,
                num_key_value_heads=arch.kv_heads, head_dim=arch.head_size,
                max_position_embeddings=arch.max_position_embeddings, rms_norm_eps=arch.rms_norm_eps,
                hidden_act=arch.hidden_act)


def layer_types(arch) -> list[str]:
    """HF's ``layer_types`` of an architecture: every layer's attention kind."""
    return list(arch.layer_types or (arch.default_layer_type,) * arch.num_hidden_layers)
