"""What train/ asks of a model config, in one place: its task, its positions, its LoRA settings
and its dtype, through the typed model interface (``models.config.ModelInterface``) and the
execution record. Code outside ``models/`` reads them only through the functions here."""

from __future__ import annotations

from shardzoo.errors import UserError


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


def with_vocab_of(student_config, teacher_config):
    """The teacher's config with the student's vocabulary padding (the same logits' width);
    teacher and student must share the tokenizer's vocabulary: else one line naming both sizes."""
    s, t = student_config.arch.vocab_size, teacher_config.arch.vocab_size
    if s != t:
        raise UserError(f"--teacher's vocab_size {t} differs from the student's {s}: "
                        "distillation needs one tokenizer (the same vocabulary)")
    if hasattr(student_config, "vocab_pad_multiple") and hasattr(teacher_config, "vocab_pad_multiple"):
        return teacher_config.replace(vocab_pad_multiple=student_config.vocab_pad_multiple)
    return teacher_config
