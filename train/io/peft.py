"""A PEFT adapter dir read onto a model's adapter leaves: its file names, the HF Linears a
model's LoRA targets are, and ``load_adapters`` (``lora_io.py`` writes such a dir)."""

from __future__ import annotations

import math
import os

from flax import traverse_util

from shardzoo.errors import UserError
from shardzoo.models import hf
from shardzoo.models.hf.tensors import _layer_weights, put_leaf
from shardzoo.models.lora import target_of
from shardzoo.train import model_info

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


class AdapterError(UserError):
    """A PEFT adapter dir that shardzoo cannot read, or a model it cannot export one for."""


def peft_linear(w) -> bool:
    """Whether PEFT adapts ``w``'s HF tensor as one ``nn.Linear`` (a column block of one too)."""
    return (w.op == "linear" and w.name.endswith(".weight") and not w.interleaved and w.groups == 1
            and not w.experts and not w.halves_swapped)


def adapted_modules(config, family) -> list[tuple[tuple, tuple[int, ...], bool, str, str, tuple[int, int]]]:
    """``(leaf path without its last name, model layers, stacked, target, HF module, part)`` of
    each adapted projection, from the family's weight map and the config's ``param_layout`` (a
    stacked leaf holds its layers on a leading axis in that order); ``part`` (j, n): the leaf is
    the j-th of n column blocks of the HF Linear (DeepSeek's kv_a and k_rope)."""
    fam = hf.family_of_config(config.replace(lora_rank=0), family)
    _, groups = _layer_weights(config, fam)
    _, targets = model_info.lora_adapters(config)
    out = []
    for prefix, layers, stacked, weights in groups:
        for w in weights:
            if len(w.path) < 2 or w.path[-1] != "kernel" or target_of(w.path[-2]) not in targets:
                continue
            t = target_of(w.path[-2])
            if not peft_linear(w):
                raise AdapterError(f"family {fam.name} stores projection {t!r} as HF tensor {w.name} (fused "
                                   f"or not a Linear as shardzoo holds it): PEFT adapters cover separate Linears only")
            out.append((prefix + w.path[:-1], layers, stacked, t, w.name.removesuffix(".weight"), w.part))
    return out


def load_adapters(path: str, target, config, family=None):
    """The adapters of a PEFT dir, placed like ``target`` (the adapter leaves' ShapeDtypeStructs)."""
    from safetensors import safe_open

    weights = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        raise AdapterError(f"--lora-from {path}: no {ADAPTER_WEIGHTS}")
    flat = traverse_util.flatten_dict(target)
    out = {}
    with safe_open(weights, framework="np") as f:
        stored = set(f.keys())

        def tensor(name, shape):
            if name not in stored:
                raise AdapterError(f"{weights}: no tensor {name!r}")
            t = f.get_tensor(name)
            if tuple(t.shape) != shape:
                raise AdapterError(f"{weights}: tensor {name!r} has shape {list(t.shape)}, the "
                                   f"model wants {list(shape)}")
            return t

        for path_, layers, stacked, _, module, part in adapted_modules(config, family):
            if part[1] > 1:
                raise AdapterError(f"--lora-from {path}: {module} is one HF Linear made of {part[1]} of "
                                   "shardzoo's projections; reading its adapter is not supported")
            for leaf_name, letter in (("lora_a", "A"), ("lora_b", "B")):
                leaf = flat[path_ + (leaf_name,)]
                per_layer = leaf.shape[1:] if stacked else leaf.shape
                rank = per_layer[-1] if letter == "A" else per_layer[0]
                other = math.prod(per_layer) // rank
                shape = (rank, other) if letter == "A" else (other, rank)

                def read(k, module=module, letter=letter, shape=shape, per_layer=per_layer, layers=layers):
                    name = f"{PREFIX}{module.replace('{i}', str(layers[k]))}.lora_{letter}.weight"
                    return tensor(name, shape).T.reshape(per_layer)

                if stacked:
                    out[path_ + (leaf_name,)] = put_leaf(leaf.shape, leaf.dtype, leaf.sharding, read,
                                                         leaf.shape[0])
                else:
                    out[path_ + (leaf_name,)] = put_leaf(leaf.shape, leaf.dtype, leaf.sharding,
                                                         lambda read=read: read(0))
    return traverse_util.unflatten_dict(out)
