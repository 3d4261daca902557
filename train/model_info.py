"""What train/ asks of a model config, in one place: its task, its positions, its LoRA settings
and its dtype. Code outside ``models/`` reads these fields only through the functions here, so a
change of the config records touches this file alone."""

from __future__ import annotations

import dataclasses


def task(config) -> str:
    """``"lm"``, ``"classification"`` or ``"regression"``."""
    return getattr(config, "task", "lm")


def max_positions(config) -> int | None:
    """How many positions the model has (None: no limit, e.g. an MLP)."""
    return getattr(config, "max_position_embeddings", None)


def has_lora(config) -> bool:
    """Whether the model can carry LoRA adapters (Transformer models can)."""
    return hasattr(config, "lora_rank")


def lora_rank(config) -> int:
    """The adapters' rank (0: none)."""
    return getattr(config, "lora_rank", 0) or 0


def lora_adapters(config) -> tuple[int, tuple[str, ...]]:
    """``(rank, targets)`` of the adapters: what a run must share to continue another's."""
    return lora_rank(config), tuple(getattr(config, "lora_targets", ()))


def param_dtype(config) -> str | None:
    return getattr(config, "param_dtype", None)


def with_dtype(config, dtype: str):
    """``config`` computing and storing its params in ``dtype``."""
    return dataclasses.replace(config, dtype=dtype, param_dtype=dtype)
