"""Reward models as a task (``--task reward``): TRL 1.16 ``RewardTrainer``'s loss and metric names.

The model is a zoo decoder with ``arch.score_head`` (a ``score`` Linear ``[embed, 1]`` in place of
the LM head, HF's ``*ForSequenceClassification`` with ``num_labels=1``); the reward of a sequence
is its score at the last real token (``segment_ids > 0``), as transformers reads it at the last
non-pad token. The batch is ``data/preference.py``'s pairs ``[batch, 2, length]`` (chosen first),
``weights`` and ``truncated`` ``[batch]``, and ``margin [batch]`` (TRL's optional column, 0 without).

Per pair ``-logsigmoid(r_chosen - r_rejected - margin)``, plus ``center_rewards_coefficient *
(r_chosen + r_rejected)^2`` (TRL's ``mean((rc + rr)^2)`` over the pairs); metrics ``accuracy``,
``margin`` (mean ``rc - rr``), ``min_reward``, ``mean_reward``, ``max_reward`` over all rewards.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from shardzoo.errors import UserError
from shardzoo.sharding import axes as ax
from shardzoo.train import model_info
from shardzoo.train.program import Program
from shardzoo.train.tasks.base import Field, Task
from shardzoo.train.tasks.component import RunTask
from shardzoo.train.tasks.preference import pair_datasets

SEQ_KEYS = ("inputs", "positions", "segment_ids")
METRICS = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward")


def sequence_rewards(scores, segment_ids):
    """Each sequence's score at its last real token: ``[rows, length, 1]`` scores, ``[rows,
    length]`` segment ids -> ``[rows]`` (a sequence without tokens reads position 0)."""
    last = jnp.maximum(jnp.sum((segment_ids > 0).astype(jnp.int32), axis=-1) - 1, 0)
    return jnp.take_along_axis(scores[..., 0].astype(jnp.float32), last[:, None], axis=-1)[:, 0]


@dataclasses.dataclass(frozen=True)
class RewardTask(Task):
    """A scalar reward on preference pairs (see the module docstring)."""

    center_rewards_coefficient: float | None = None

    @property
    def tiles_head(self) -> bool:
        return False  # the score head's outputs are the rewards

    def fields(self, config, batch_size: int, seq_len: int | None) -> dict[str, Field]:
        pair, names = (batch_size, 2, seq_len), (ax.BATCH, None, ax.LENGTH)
        fields = {k: Field(pair, "int32", names) for k in SEQ_KEYS}
        for k in ("weights", "truncated", "margin"):
            fields[k] = Field((batch_size,), "float32", (ax.BATCH,))
        return fields

    def model_args(self, batch) -> tuple[tuple, dict]:
        rows = lambda x: x.reshape((-1,) + x.shape[2:])  # [batch, 2, length] -> [2 * batch, length]
        return (rows(batch["inputs"]),), {"positions": rows(batch["positions"]),
                                          "segment_ids": rows(batch["segment_ids"])}

    def rewards(self, outputs, batch):
        """``[batch, 2]``: the chosen and rejected sequences' rewards."""
        segments = batch["segment_ids"]
        return sequence_rewards(outputs, segments.reshape((-1,) + segments.shape[2:])).reshape(segments.shape[:2])

    def sums(self, outputs, batch, totals=None) -> dict:
        """Weighted sums over the pairs (``sums[k] / sum(weights)`` is the step's ``k``); the
        rewards' min and max over the real pairs."""
        w = batch["weights"].astype(jnp.float32)
        r = self.rewards(outputs, batch)
        diff = r[:, 0] - r[:, 1]
        losses = -jax.nn.log_sigmoid(diff - batch["margin"].astype(jnp.float32))
        if self.center_rewards_coefficient is not None:
            losses = losses + self.center_rewards_coefficient * (r[:, 0] + r[:, 1]) ** 2
        real = (w > 0)[:, None]
        return {
            "loss": jnp.sum(losses * w), "weight": jnp.sum(w),
            "accuracy": jnp.sum((diff > 0).astype(jnp.float32) * w), "margin": jnp.sum(diff * w),
            "mean_reward": jnp.sum(jnp.mean(r, axis=1) * w),
            "min_reward": jnp.min(jnp.where(real, r, jnp.inf)), "max_reward": jnp.max(jnp.where(real, r, -jnp.inf)),
            "pairs_truncated": jnp.sum(batch["truncated"].astype(jnp.float32) * w),
        }

    def extra_metrics(self, sums, total_weight) -> dict:
        """TRL's metrics: means over the pairs, the min and max as they are, the truncated count."""
        out = {k: sums[k] / total_weight for k in ("accuracy", "margin", "mean_reward")}
        return {**out, "min_reward": sums["min_reward"], "max_reward": sums["max_reward"],
                "pairs_truncated": sums["pairs_truncated"]}


def reward_task(center_rewards_coefficient: float | None = None) -> RewardTask:
    """The ``reward`` task; a negative coefficient is a one-line UserError."""
    if center_rewards_coefficient is not None and not center_rewards_coefficient >= 0:
        raise UserError(f"--center-rewards-coefficient must be 0 or more, got {center_rewards_coefficient}")
    return RewardTask("reward", "examples", "loss", has_accuracy=False, has_perplexity=False,
                      signals=("accuracy", "margin"), center_rewards_coefficient=center_rewards_coefficient)


# ------------------------------------------------------------------------------ a reward model as a GRPO reward
@dataclasses.dataclass(frozen=True)
class ScoreTask(Task):
    """A reward model's scores of ``[batch, length]`` right-padded rows (``--reward-model``):
    ``sums`` gives each row's score at its last real token (``rewards [batch]``)."""

    def fields(self, config, batch_size: int, seq_len: int | None) -> dict[str, Field]:
        rows, names = (batch_size, seq_len), (ax.BATCH, ax.LENGTH)
        return {**{k: Field(rows, "int32", names) for k in SEQ_KEYS},
                "weights": Field((batch_size,), "float32", (ax.BATCH,))}

    def model_args(self, batch) -> tuple[tuple, dict]:
        return (batch["inputs"],), {"positions": batch["positions"], "segment_ids": batch["segment_ids"]}

    @property
    def tiles_head(self) -> bool:
        return False  # the score head's outputs are the rewards

    def sums(self, outputs, batch, totals=None) -> dict:
        return {"rewards": sequence_rewards(outputs, batch["segment_ids"])}


def reward_model_config(spec: str):
    """``--reward-model``'s model config: a run, checkpoint or HF ``*ForSequenceClassification``
    dir with a score head (training loads its params), or a zoo name (``shardzoo plan`` counts
    its bytes, a score head in place of the LM head)."""
    import os

    if not os.path.exists(spec):
        from shardzoo.models import ModelError, get_config

        try:
            config = get_config(spec)
        except ModelError:
            raise UserError(f"--reward-model {spec}: neither a run, checkpoint or HF dir nor a zoo model name") \
                from None
        return config.replace(score_head=True) if getattr(config, "task", None) == "lm" else config
    from shardzoo.train.io.sources import open_source

    config = open_source(spec, what="--reward-model").config
    if not getattr(getattr(config, "arch", None), "score_head", False):
        raise UserError(f"--reward-model {spec}: not a reward model (a --task reward run, or an HF "
                        "*ForSequenceClassification with num_labels=1)")
    return config


def reward_model_program(spec: str, rules, mesh, *, batch_size: int, seq_len: int, strict: bool = True):
    """The params-only Program of ``--reward-model``: its params sharded by the run's rules on
    the run's mesh, its scoring step on ``batch_size`` rows of ``seq_len`` tokens."""
    from shardzoo.train.defaults import pad_vocab

    config, _ = pad_vocab(reward_model_config(spec), rules, mesh)
    task = ScoreTask("reward_model", "examples", "loss", has_accuracy=False, has_perplexity=False)
    return Program(config, rules, mesh, task=task, batch_size=batch_size, seq_len=seq_len, strict=strict)


class RewardModel:
    """``--reward-model`` as a GRPO/RLOO reward function, as TRL's ``GRPOTrainer`` calls a
    reward model: each prompt + completion as text (conversational ones rendered with the reward
    model's chat template), tokenized by the reward model's tokenizer without special tokens,
    right-padded, and scored at the last token. Rows longer than the run's ``--seq-len`` keep
    their last ``seq_len`` tokens (TRL does not cut them)."""

    def __init__(self, spec: str, program, tokenizer):
        import os

        from shardzoo.train.io.sources import open_source

        self.spec, self.program, self.tokenizer = spec, program, tokenizer
        self.name = os.path.basename(os.path.normpath(spec))  # TRL: the model id's last part
        vocab = program.config.arch.vocab_size
        if tokenizer.vocab_size > vocab:
            raise UserError(f"--reward-model {spec}: its tokenizer {tokenizer.spec} has {tokenizer.vocab_size} ids, "
                            f"the model vocab_size {vocab}")
        self.params = open_source(spec, what="--reward-model").load_params(program.params_target(), program.config)
        self._renderer = None

    def texts(self, prompts, completions) -> list[str]:
        """TRL's texts: ``prompt + completion``, or the messages rendered by the chat template."""
        if prompts and isinstance(prompts[0], (list, tuple)):
            if self._renderer is None:
                from shardzoo.data.chat import renderer_for

                self._renderer = renderer_for(self.tokenizer, "prompt")
            return [self._renderer.render(list(p) + list(c)) for p, c in zip(prompts, completions, strict=True)]
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    def rows(self, ids) -> dict:
        """The scoring batch of token lists (right-padded; the last ``seq_len`` tokens of longer ones)."""
        rows, width = self.program.batch_size, self.program.seq_len
        out = {k: np.zeros((rows, width), np.int32) for k in SEQ_KEYS}
        out["inputs"][:] = self.tokenizer.pad_id
        out["weights"] = np.zeros(rows, np.float32)
        for i, row in enumerate(ids):
            row = np.asarray(row, np.int32)[-width:]
            out["inputs"][i, : len(row)] = row
            out["positions"][i, : len(row)] = np.arange(len(row))
            out["segment_ids"][i, : len(row)] = 1
            out["weights"][i] = 1.0
        return out

    def __call__(self, prompts, completions, completion_ids=None, **columns) -> list[float]:
        ids = self.tokenizer.encode_batch(self.texts(prompts, completions))
        step, per_call, out = self.program.compiled_eval_step(), self.program.batch_size, []
        for start in range(0, len(ids), per_call):
            placed = self.program.place_global(self.rows(ids[start: start + per_call]))
            scores = np.asarray(jax.device_get(step(self.params, placed)["rewards"]), np.float32)
            out += scores[: len(ids[start: start + per_call])].tolist()
        return out


class RewardRun(RunTask):
    """``--task reward``: a decoder with a score head on preference pairs (a language model's
    gets a score head for its LM head, as transformers' ``*ForSequenceClassification`` of it)."""

    name = eval_task = "reward"
    preference = True

    def model(self, cfg, config):
        return config.replace(score_head=True) if model_info.task(config) == "lm" else config

    def task(self, cfg, config):
        if not getattr(getattr(config, "arch", None), "score_head", False):
            raise UserError(f"--task reward trains a decoder with a score head; the model does {config.task}")
        return reward_task(cfg.center_rewards_coefficient), None

    def datasets(self, cfg, data_config, tokenizer, mesh, rules, program):
        return pair_datasets(cfg, data_config, tokenizer, mesh, rules)

    def default(self):
        return reward_task()

    # ``shardzoo eval --task reward`` (``tasks/preference_eval.py``): a reward model's loss and
    # TRL's accuracy, margin and rewards over preference pairs, no reference
    eval_rows = "pairs"

    def eval_task_of(self, settings: dict, s, config):
        if not getattr(getattr(config, "arch", None), "score_head", False):
            raise UserError("--task reward scores with a reward model: this model has no score head")
        return reward_task(settings.get("center_rewards_coefficient"))

    def eval_details(self, task, reference) -> dict:
        return {}

    def format_eval(self, metrics: dict) -> str:
        return (f"reward over {metrics['pairs']} pairs: loss {metrics['loss']:.4f}, accuracy {metrics['accuracy']:.4f}, "
                f"margin {metrics['margin']:.4f}, rewards min/mean/max {metrics['min_reward']:.4f} / "
                f"{metrics['mean_reward']:.4f} / {metrics['max_reward']:.4f}")
