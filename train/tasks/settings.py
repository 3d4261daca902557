"""Each ``--task``'s own settings: the flags only it takes, its ``--loss`` choices and the checks
of its values, one entry per task in ``TASK_SETTINGS``.

``TrainConfig`` (``train/config.py``) asks the run's entry to check the settings, and refuses a
task-only flag changed from its default under a task that does not take it. The task
components (``tasks/registry.py``) read their entry as ``settings``. The module imports nothing
of ``train/``: the settings are checked before any task's code loads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from shardzoo.errors import ConfigError

DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm", "simpo", "orpo")
KTO_LOSSES = ("kto", "apo_zero_unpaired")
GRPO_LOSSES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")  # TRL 1.16's
IMPORTANCE_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
GRPO_OPTIONS = ("importance_sampling_level", "use_bias_correction_kl", "delta", "sapo_temperature_neg",
                "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
                "top_entropy_quantile", "entropy_coef")  # TRL's GRPOConfig's, not RLOOConfig's
RLOO_OPTIONS = ("normalize_advantages", "reward_clip_range")
SAMPLING = ("reward_funcs", "reward_model", "reward_weights", "num_generations", "num_iterations", "epsilon", "epsilon_high",
            "mask_truncated_completions", "temperature", "top_k", "top_p")  # GRPO's and RLOO's
DPO_SETTINGS = ("loss_weights", "ld_alpha", "f_divergence_type", "f_alpha_divergence_coef", "discopop_tau",
                "use_weighting")
PROMPTED = ("reference", "max_prompt_length", "max_completion_length")  # the preference and rollout tasks'
ON_POLICY = ("max_prompt_length", "max_completion_length", "top_k", "top_p")  # on-policy GKD's too


def _nothing(cfg) -> None:
    return None


def _never(cfg) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """One ``--task``'s settings: ``owns`` the task-only settings it takes (any task that owns
    none of them refuses them changed from their defaults), ``losses`` its ``--loss`` choices
    (None: it refuses ``--loss``), ``values(cfg)`` the checks of their values (a ConfigError
    naming the flag), and ``on_policy(cfg)``: whether the run samples its completions as
    on-policy distillation does, when it also takes the sampler's ``ON_POLICY`` settings."""

    name: str | None
    owns: tuple[str, ...] = ()
    losses: tuple[str, ...] | None = None
    values: Callable = _nothing
    on_policy: Callable = _never

    def takes(self, name: str, cfg) -> bool:
        """Whether this task takes the task-only setting ``name`` under ``cfg``."""
        return name in self.owns or (name in ON_POLICY and self.on_policy(cfg))

    def check(self, cfg) -> None:
        """The run's settings (a TrainConfig) as this task takes them."""
        if self.losses is None and cfg.loss is not None:
            raise ConfigError(f"--loss {cfg.loss}: a setting of --task {said(loss_owners())}")
        self.values(cfg)


def said(names) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def owners(name: str) -> list[str]:
    """The tasks that own the task-only setting ``name``, in ``TASK_SETTINGS``' order."""
    return [t.name for t in TASK_SETTINGS.values() if name in t.owns]


def loss_owners() -> list[str]:
    """The tasks with a choice of ``--loss``."""
    return [t.name for t in TASK_SETTINGS.values() if t.losses]


# ------------------------------------------------------------------------------ the checks
def _dpo(cfg) -> None:
    unknown = [x for x in (cfg.loss or "sigmoid").split(",") if x not in DPO_LOSSES]
    if unknown:
        raise ConfigError(f"--loss {unknown[0]!r}: --task dpo takes one or more (comma-separated) of "
                          f"{', '.join(DPO_LOSSES)}")


def _kto(cfg) -> None:
    if cfg.loss is not None and cfg.loss not in KTO_LOSSES:
        raise ConfigError(f"--loss {cfg.loss!r}: --task kto takes one of {', '.join(KTO_LOSSES)}")


def _grpo(cfg) -> None:
    if cfg.loss is not None and cfg.loss not in GRPO_LOSSES:
        raise ConfigError(f"--loss {cfg.loss!r}: --task grpo takes one of {', '.join(GRPO_LOSSES)}")
    _rollouts(cfg)


def _rloo(cfg) -> None:
    if cfg.loss is not None:
        raise ConfigError(f"--loss {cfg.loss!r}: --task rloo has one loss (TRL's RLOOTrainer has no loss_type)")
    _rollouts(cfg)


def _rollouts(cfg) -> None:
    """GRPO's and RLOO's sampling and rewards in range."""
    if cfg.beta is not None and not (math.isfinite(cfg.beta) and cfg.beta >= 0):
        raise ConfigError(f"--beta must be a finite number >= 0 for --task {cfg.task}, got {cfg.beta}")
    if cfg.importance_sampling_level not in IMPORTANCE_LEVELS:
        raise ConfigError(f"--importance-sampling-level {cfg.importance_sampling_level!r}: choose one of "
                          f"{', '.join(IMPORTANCE_LEVELS)}")
    if not 0.0 <= cfg.top_entropy_quantile <= 1.0:
        raise ConfigError(f"--top-entropy-quantile must be in [0, 1], got {cfg.top_entropy_quantile}")
    clip = cfg.reward_clip_range
    if clip is not None and (len(clip) != 2 or not clip[0] <= clip[1]):
        raise ConfigError(f"--reward-clip-range takes MIN,MAX with MIN <= MAX, got {','.join(map(str, clip))}")
    rewards = len(cfg.reward_funcs) + bool(cfg.reward_model)
    if cfg.reward_weights is not None and len(cfg.reward_weights) != rewards:
        raise ConfigError(f"--reward-weights has {len(cfg.reward_weights)} values for "
                          f"{len(cfg.reward_funcs)} --reward-funcs"
                          + (" and the --reward-model" if cfg.reward_model else ""))
    if cfg.num_generations < 2:
        raise ConfigError(f"--num-generations must be at least 2 (a group), got {cfg.num_generations}")
    if cfg.batch_size % cfg.num_generations:
        raise ConfigError(f"--batch-size {cfg.batch_size} (completions per step) is not divisible by "
                          f"--num-generations {cfg.num_generations}")
    if cfg.num_iterations < 1:
        raise ConfigError(f"--num-iterations must be at least 1, got {cfg.num_iterations}")
    for flag, value in (("--epsilon", cfg.epsilon), ("--epsilon-high", cfg.epsilon_high)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{flag} must be a finite number >= 0, got {value}")
    if cfg.scale_rewards not in SCALE_REWARDS:
        raise ConfigError(f"--scale-rewards {cfg.scale_rewards!r}: choose one of {', '.join(SCALE_REWARDS)}")
    if cfg.multi_objective_aggregation not in AGGREGATIONS:
        raise ConfigError(f"--multi-objective-aggregation {cfg.multi_objective_aggregation!r}: choose one of "
                          f"{', '.join(AGGREGATIONS)}")
    if not (math.isfinite(cfg.temperature) and cfg.temperature > 0):
        raise ConfigError(f"--temperature must be > 0 (GRPO samples), got {cfg.temperature}")
    if cfg.top_k < 0 or not 0 < cfg.top_p <= 1:
        raise ConfigError(f"--top-k must be >= 0 and --top-p in (0, 1], got {cfg.top_k} and {cfg.top_p}")
    completion = cfg.max_completion_length
    if completion is not None and not 1 <= completion < cfg.seq_len:
        raise ConfigError(f"--max-completion-length {completion} must be from 1 to --seq-len - 1 "
                          f"({cfg.seq_len - 1}): each row holds the prompt and its completion")
    if cfg.precompute_reference:
        raise ConfigError(f"--precompute-reference: {cfg.task.upper()}'s completions are sampled while training; "
                          "the reference scores them as they come")


def _distill(cfg) -> None:
    """``--task distill`` needs ``--teacher``; its settings in range."""
    if not cfg.teacher:
        raise ConfigError("--task distill needs --teacher DIR (the teacher's run or HF dir)")
    if cfg.beta is not None and not 0.0 <= cfg.beta <= 1.0:
        raise ConfigError(f"--beta {cfg.beta} must be in [0, 1] for --task distill (0: forward KL, 1: reverse)")
    if not (math.isfinite(cfg.temperature) and cfg.temperature > 0):
        raise ConfigError(f"--temperature must be > 0, got {cfg.temperature}")
    if cfg.distill_top_k < 0:
        raise ConfigError(f"--distill-top-k must be >= 0 (0: the whole vocabulary), got {cfg.distill_top_k}")
    if not 0.0 <= cfg.lmbda <= 1.0:
        raise ConfigError(f"--lmbda must be in [0, 1] (the share of on-policy steps), got {cfg.lmbda}")


def _samples(cfg) -> bool:
    """On-policy GKD: ``--lmbda`` > 0 or ``--seq-kd`` (``train/tasks/gkd.py``)."""
    return cfg.lmbda > 0 or cfg.seq_kd


TASK_SETTINGS = {t.name: t for t in (
    TaskSettings(None),  # the model's own task
    TaskSettings("lm"),
    TaskSettings("dpo", (*PROMPTED, "precompute_reference", *DPO_SETTINGS), DPO_LOSSES, _dpo),
    TaskSettings("kto", (*PROMPTED, "precompute_reference", "desirable_weight", "undesirable_weight"), KTO_LOSSES,
                 _kto),
    TaskSettings("grpo", (*PROMPTED, *SAMPLING, "scale_rewards", "multi_objective_aggregation", *GRPO_OPTIONS),
                 GRPO_LOSSES, _grpo),
    TaskSettings("rloo", (*PROMPTED, *SAMPLING, *RLOO_OPTIONS), (), _rloo),  # one loss: its own refusal of --loss
    TaskSettings("reward", ("center_rewards_coefficient",)),
    TaskSettings("distill", ("temperature", "teacher", "distill_top_k", "lmbda", "seq_kd"), values=_distill,
                 on_policy=_samples),
)}
TASKS = tuple(TASK_SETTINGS)  # the --task choices (None: the model's own)
# every task-only setting, each refused by the tasks that do not own it
OWNED = tuple(dict.fromkeys(name for t in TASK_SETTINGS.values() for name in t.owns))
