"""Distillation as a task: the student learns the teacher's next-token distributions (TRL's GKD).

The batch is ``lm``'s (``inputs, targets, positions, segment_ids``, the loss mask ``weights``)
plus the teacher's logits ``teacher_logits [batch, length, vocab]``, which the program's teacher
step fills in before the train step (a later key, as the DPO reference's log-probs). The teacher
is a second frozen model, possibly of another family, sharing the student's tokenizer (the same
vocabulary size).

The per-token loss is TRL's ``GKDTrainer.generalized_jsd_loss`` (its ``beta``, ``temperature``):
with ``p_s``, ``p_t`` the softmaxes of the student's and teacher's logits over ``temperature``,
``beta = 0`` is the forward KL ``KL(p_t || p_s)``, ``beta = 1`` the reverse ``KL(p_s || p_t)``,
and between them the generalized JSD ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with
``m = (1 - beta) p_s + beta p_t``; summed over the loss mask and divided by its weight (TRL's
``batchmean`` over unmasked tokens). ``top_k > 0`` keeps the teacher's ``k`` likeliest tokens of
each position (its distribution renormalized over them) and sums the divergence over those.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from shardzoo.errors import UserError
from shardzoo.sharding import axes as ax
from shardzoo.train.config import ConfigError
from shardzoo.train.tasks.base import Field, Task
from shardzoo.train.tasks.component import RunTask, language_model_only


def generalized_jsd(student_logits, teacher_logits, *, beta: float = 0.5, temperature: float = 1.0,
                    top_k: int = 0):
    """Per-position divergence ``[...]`` of the student's from the teacher's ``[..., vocab]``
    logits (the module docstring); float32."""
    low = jnp.finfo(jnp.float32).min  # a padded vocabulary's masked logits stay finite over a temperature < 1

    def log_probs(logits):
        return jax.nn.log_softmax(jnp.maximum(logits.astype(jnp.float32) / temperature, low), axis=-1)

    s, t = log_probs(student_logits), log_probs(teacher_logits)
    if top_k:
        t, index = jax.lax.top_k(t, top_k)
        t = t - jax.nn.logsumexp(t, axis=-1, keepdims=True)
        s = jnp.take_along_axis(s, index, axis=-1)

    def kl(log_p, log_q):  # KL(p || q), summed over the vocabulary
        return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)

    if beta == 0:
        return kl(t, s)
    if beta == 1:
        return kl(s, t)
    m = jnp.logaddexp(s + jnp.log1p(-beta), t + jnp.log(beta))
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


@dataclasses.dataclass(frozen=True)
class DistillTask(Task):
    """Distillation on ``lm`` batches against the teacher's logits (the module docstring)."""

    beta: float = 0.0  # 0: forward KL (TRL GKD's default is 0.5, DistillationTrainer's 1.0)
    temperature: float = 1.0
    top_k: int = 0  # 0: the whole vocabulary
    samples: bool = False  # on-policy (``--lmbda``/``--seq-kd``, ``train/tasks/gkd.py``): completions sampled each step
    teacher_samples: bool = False  # ``--seq-kd``: the teacher samples the steps the student does not

    @property
    def tiles_head(self) -> bool:
        return False  # the divergence reads the whole distribution

    @property
    def reference_keys(self) -> tuple[str, ...]:
        return ("teacher_logits",)

    def fields(self, config, batch_size: int, seq_len: int | None) -> dict[str, Field]:
        fields = dict(Task.fields(dataclasses.replace(self, name="lm"), config, batch_size, seq_len))
        vocab = getattr(config, "padded_vocab", config.arch.vocab_size)  # the head's rows (padded: masked)
        fields["teacher_logits"] = Field((batch_size, seq_len, vocab), "float32",
                                         (ax.BATCH, ax.LENGTH, ax.VOCAB))
        return fields

    def model_args(self, batch):
        return (batch["inputs"],), {"positions": batch["positions"], "segment_ids": batch["segment_ids"]}

    def sums(self, outputs, batch) -> dict:
        weights = batch["weights"].astype(jnp.float32)
        loss = generalized_jsd(outputs, batch["teacher_logits"], beta=self.beta, temperature=self.temperature,
                               top_k=self.top_k)
        correct = (jnp.argmax(outputs, -1) == batch["targets"]).astype(jnp.float32)
        return {"loss": jnp.sum(loss * weights), "weight": jnp.sum(weights), "correct": jnp.sum(correct * weights)}


def distill_task(beta: float = 0.0, temperature: float = 1.0, top_k: int = 0, samples: bool = False,
                 teacher_samples: bool = False) -> DistillTask:
    """The ``distill`` task; ``beta`` in [0, 1], ``temperature`` > 0, ``top_k`` >= 0 (TRL's names);
    ``samples``: on-policy, its completions sampled while training (the plan counts the sampler's cache);
    ``teacher_samples``: the teacher samples too (``--seq-kd``; the plan counts the larger cache)."""
    if not 0.0 <= beta <= 1.0:
        raise UserError(f"--beta {beta} must be between 0 (forward KL) and 1 (reverse KL) for --task distill")
    if temperature <= 0:
        raise UserError(f"--temperature {temperature} must be positive for --task distill")
    if top_k < 0:
        raise UserError(f"--distill-top-k {top_k} must be 0 (the whole vocabulary) or positive")
    return DistillTask("distill", "tokens", "distill_loss", has_accuracy=True, has_perplexity=False,
                       beta=beta, temperature=temperature, top_k=top_k, samples=bool(samples),
                       teacher_samples=bool(teacher_samples))


def teacher_config(spec: str):
    """``--teacher``'s model config: a run, checkpoint or HF dir (training loads its params), or
    a zoo model name (``shardzoo plan`` counts its bytes)."""
    import os

    if os.path.exists(spec):
        from shardzoo.train.io.sources import open_source

        return open_source(spec, what="--teacher").config
    from shardzoo.models import ModelError, get_config

    try:
        return get_config(spec)
    except ModelError:
        raise UserError(f"--teacher {spec}: neither a run, checkpoint or HF dir nor a zoo model name") from None


class DistillRun(RunTask):
    """``--task distill --teacher DIR``: the teacher a model of its own (any family with the
    student's vocabulary), frozen, its logits filled in by the program's teacher step."""

    name = "distill"

    def task(self, cfg, config):
        language_model_only(cfg, config)
        return distill_task(cfg.beta or 0.0, cfg.temperature, cfg.distill_top_k, samples=cfg.on_policy,
                            teacher_samples=cfg.seq_kd), "teacher"

    def teacher(self, cfg, config):
        return teacher_config(cfg.teacher)

    def check(self, cfg) -> None:
        import os

        if not os.path.exists(cfg.teacher):  # plan takes a zoo name; training, weights
            raise ConfigError(f"--teacher {cfg.teacher}: training needs the teacher's weights (a run, checkpoint "
                              "or HF dir)")

    def datasets(self, cfg, data_config, tokenizer, mesh, rules, program):
        if not cfg.on_policy:
            return super().datasets(cfg, data_config, tokenizer, mesh, rules, program)
        from shardzoo.train.tasks.gkd import gkd_data  # distillation on sampled completions

        return gkd_data(cfg, tokenizer), None

    def trainer(self, cfg):
        if not cfg.on_policy:
            return super().trainer(cfg)
        from shardzoo.train.tasks.gkd import GKDTrainer

        return GKDTrainer

    def frozen_params(self, cfg, program):
        from shardzoo.train.io.sources import open_source

        return lambda target: open_source(cfg.teacher, what="--teacher").load_params(target, program.teacher.config)

    def default(self):
        return distill_task()
