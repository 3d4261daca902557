"""LoRA: low-rank adapters on a Transformer's projections, PEFT's way.

A projection ``y = x W`` named in ``lora_targets`` gets two more parameters, ``lora_a``
``[inputs..., lora_rank]`` (uniform in +-1/sqrt(fan_in), PEFT's kaiming-uniform) and ``lora_b``
``[lora_rank, outputs...]`` (zeros), and computes ``y = x W + (alpha / rank) (x A) B`` without
ever forming ``W + A B`` (``layers.Linear``). ``A`` names the kernel's input axes, ``B`` its
output axes, and the rank axis is ``lora_rank`` (replicated by every rule table). At
initialisation ``B = 0``, so the adapted model computes exactly the base model.

Here: the config's checks, which parameters are adapters (the ones a LoRA run trains), and the
merge of adapters into their kernels for export.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import traverse_util

from shardzoo.models import ModelError

# the projections' names in layers.py: attention, latent attention (DeepSeek's q_a, q_b, kv_a,
# kv_b), MLP (dense and shared experts); routed experts are no Linear and are not adapted
TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "q_a", "q_b", "kv_a", "kv_b")
# Linears adapted as part of another target: latent attention's k_rope is the rest of HF's
# kv_a_proj_with_mqa, which PEFT adapts as one Linear
TARGET_OF = {"k_rope": "kv_a"}


def target_of(name: str) -> str:
    """The ``lora_targets`` name that adapts the Linear named ``name``."""
    return TARGET_OF.get(name, name)
ADAPTERS = ("lora_a", "lora_b")


def check_lora(config) -> None:
    """The LoRA fields of a config: rank >= 0, alpha > 0, targets among ``TARGETS``."""
    rank, alpha, targets = config.lora_rank, config.lora_alpha, config.lora_targets
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ModelError(f"lora_rank={rank!r} must be an integer >= 0 (0: no adapters)")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                              or not math.isfinite(alpha) or not alpha > 0):
        raise ModelError(f"lora_alpha={alpha!r} must be a finite number > 0")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ModelError(f"lora_targets={','.join(targets)!r}: choose among {','.join(TARGETS)}")


def lora_scale(config) -> float:
    """``alpha / rank`` (alpha defaults to the rank: scale 1, as PEFT's r=8, lora_alpha=8)."""
    alpha = config.lora_alpha if config.lora_alpha is not None else config.lora_rank
    return float(alpha) / config.lora_rank


def linear_lora(config) -> tuple:
    """What ``layers.Linear`` needs: ``(rank, scale, targets)``, or ``()`` without adapters."""
    if not getattr(config, "lora_rank", 0):
        return ()
    return (config.lora_rank, lora_scale(config), tuple(config.lora_targets))


def is_adapter(path) -> bool:
    """Whether the parameter at ``path`` (a tuple of names) is a LoRA adapter."""
    return path[-1] in ADAPTERS


def trainable_filter(config):
    """The predicate on parameter paths that a run trains: the adapters when the config has them,
    else None (everything)."""
    return is_adapter if getattr(config, "lora_rank", 0) else None


def split(params, trains):
    """``(trained, frozen)``: the params (a nested dict) whose paths ``trains`` accepts, and the
    rest; ``trains=None`` trains everything (``frozen`` is None)."""
    if trains is None:
        return params, None
    flat = traverse_util.flatten_dict(params)
    trained = {k: v for k, v in flat.items() if trains(k)}
    frozen = {k: v for k, v in flat.items() if not trains(k)}
    return traverse_util.unflatten_dict(trained), traverse_util.unflatten_dict(frozen)


def join(trained, frozen):
    """The inverse of ``split``."""
    if frozen is None:
        return trained
    flat = {**traverse_util.flatten_dict(frozen), **traverse_util.flatten_dict(trained)}
    return traverse_util.unflatten_dict(flat)


def merge_lora(config, params):
    """``(config without adapters, params)`` with ``scale * A B`` folded into every adapted kernel
    (in float32, then the kernel's dtype); the adapters are dropped."""
    flat = traverse_util.flatten_dict(params)
    scale, out = lora_scale(config), {}
    for path, leaf in flat.items():
        if is_adapter(path):
            continue
        a = flat.get(path[:-1] + ("lora_a",))
        if path[-1] == "kernel" and a is not None:
            b = flat[path[:-1] + ("lora_b",)]
            lead = a.ndim + b.ndim - 2 - leaf.ndim  # 1: a scanned ``layers`` axis in front
            rank = a.shape[-1]
            a2 = a.astype(jnp.float32).reshape(a.shape[:lead] + (-1, rank))
            b2 = b.astype(jnp.float32).reshape(b.shape[:lead] + (rank, -1))
            delta = jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST).reshape(leaf.shape)
            leaf = (leaf.astype(jnp.float32) + scale * delta).astype(leaf.dtype)
        out[path] = leaf
    return config.replace(lora_rank=0), traverse_util.unflatten_dict(out)
