"""What train/ asks of a model config, in one place: its task, its positions, its LoRA settings
and its dtype, through the typed model interface (``models.config.ModelInterface``) and the
execution record. Code outside ``models/`` reads them only through the functions here."""

from __future__ import annotations


def task(config) -> str:
    """``"lm"``, ``"classification"`` or ``"regression"``."""
    return config.task


def max_positions(config) -> int | None:
    """How many positions the model has (None: no limit, e.g. an MLP)."""
    return config.max_positions


def has_lora(config) -> bool:
    """Whether the model can carry LoRA adapters (Transformer models can)."""
    return hasattr(config.execution, "lora_rank")


def lora_rank(config) -> int:
    """The adapters' rank (0: none)."""
    return getattr(config.execution, "lora_rank", 0) or 0


def lora_adapters(config) -> tuple[int, tuple[str, ...]]:
    """``(rank, targets)`` of the adapters: what a run must share to continue another's."""
    return lora_rank(config), tuple(getattr(config.execution, "lora_targets", ()))


def param_dtype(config) -> str:
    return config.execution.param_dtype


def with_dtype(config, dtype: str):
    """``config`` computing and storing its params in ``dtype``."""
    return config.replace(dtype=dtype, param_dtype=dtype)
