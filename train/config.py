"""Every setting of a training run: one frozen dataclass in sections, its flags and its YAML.

The settings come in sections (``SECTIONS``: model, data, optimizer, sharding, checkpoint,
logging, distributed, runtime); ``run.json`` and ``--config FILE`` use that form::

    model: {model: llama-tiny, override: {hidden_size: 64}}
    data: {data: corpus.jsonl, batch_size: 32, seq_len: 256}
    optimizer: {lr: 3.0e-3, steps: 1000}

(a flat mapping of settings is read too). Every flag keeps its field's name, and each setting
lives in one section only; ``TrainConfig.section(name)`` gives one section's values (the data
section is what ``data.DataConfig`` is built from). Precedence: the defaults, then
``--config``, then the flags. Values go through the one coercer, ``shardzoo.values.coerce``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing

from shardzoo.errors import UserError
from shardzoo.train.xla_flags import XLA_PRESET_HELP, XLA_PRESETS
from shardzoo.values import check_seed, coerce

OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "lion")
SCHEDULES = ("cosine", "linear", "constant")
TASKS = (None, "lm", "dpo", "kto", "grpo", "rloo", "reward", "distill")
KTO_LOSSES = ("kto", "apo_zero_unpaired")
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm", "simpo", "orpo")
GRPO_LOSSES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")  # TRL 1.16's
IMPORTANCE_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
GRPO_OPTIONS = ("importance_sampling_level", "use_bias_correction_kl", "delta", "sapo_temperature_neg",
                "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
                "top_entropy_quantile", "entropy_coef")  # TRL's GRPOConfig's, not RLOOConfig's
RLOO_OPTIONS = ("normalize_advantages", "reward_clip_range")
NONFINITE_EXIT = 3  # exit status of a run stopped by a NaN/Inf loss or gradient


class ConfigError(UserError):
    """A bad training setting: a flag value, a --config file or a key in it."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run's settings; the defaults train llama-tiny on the embedded corpus."""

    out: str | None = None
    # model, sharding
    model: str = "llama-tiny"
    override: tuple[str, ...] = ()
    rules: str | None = None  # default: fsdp on >1 device, dp on one
    opt_rules: str | None = None  # default: the optimizer state follows its params
    mesh: str | None = None  # default: every device on the first of fsdp, tensor the rules use, else data
    # LoRA (model section): adapters on the base model's projections, the only params trained
    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: float | None = None  # default: the rank (scale alpha / rank = 1)
    lora_targets: tuple[str, ...] | None = None  # None: every Linear the model has but the lm head
    lora_base_dtype: str | None = None  # e.g. bfloat16: the frozen base's param_dtype
    lora_from: str | None = None  # a PEFT adapter dir to continue training (with --init-from)
    # the remat policy: "auto" (the fastest whose step fits the device, train/fit.py) or a policy
    # name; None: auto on an accelerator, the model's own (none) on CPU. A run records the
    # policy it chose, never "auto".
    remat: str | None = None
    # data
    data: str = "stdlib"  # the embedded standard-library corpus
    text_column: str = "text"
    prompt_column: str | None = None
    completion_column: str | None = None
    chat_column: str | None = None  # conversations: loss on assistant turns only
    label_column: str | None = None  # classification/regression: the label column
    feature_columns: tuple[str, ...] | None = None  # default: every column but the label
    eval_data: str | None = None
    eval_fraction: float | None = None  # default: 0.05 of the embedded corpus, else 0
    skip_missing: bool = False  # skip (and count) rows with a null text, prompt or completion
    max_prompt_length: int | None = None  # preference pairs: keep the prompt's last N tokens
    max_completion_length: int | None = None  # preference pairs: keep each completion's first N tokens
    tokenizer: str = "byte"
    add_bos: bool = False
    batch_size: int = 16  # global, over all devices and microbatches
    seq_len: int = 128
    # task: None trains what the model does (next tokens, or its labels); "dpo": preference pairs;
    # "grpo": reinforcement learning on sampled completions scored by reward functions; "rloo": the same
    # rollouts, RLOO's leave-one-out advantages and loss
    task: str | None = None
    loss: str | None = None  # dpo: sigmoid (default) | ipo | hinge | simpo | orpo; grpo: GRPO_LOSSES, dapo (default)
    beta: float | None = None  # dpo: 0.1 by default; grpo: the KL coefficient, 0 by default (no reference); rloo: 0.05
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    cpo_alpha: float = 0.0  # simpo: weight of the chosen completions' NLL (TRL's CPOConfig.cpo_alpha)
    loss_weights: tuple[float, ...] | None = None  # dpo: one per comma-separated --loss (TRL's MPO; default 1 each)
    ld_alpha: float | None = None  # dpo: LD-DPO's weight of the tokens past the shorter completion's length
    f_divergence_type: str = "reverse_kl"  # dpo: f-DPO's regularizer
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05
    use_weighting: bool = False  # dpo: WPO's weights, each pair's loss times its sequences' weighted probabilities
    desirable_weight: float = 1.0  # kto: weight of the desirable rows' losses (TRL's KTOConfig)
    undesirable_weight: float = 1.0  # kto: weight of the undesirable rows' losses
    center_rewards_coefficient: float | None = None  # reward: TRL's weight of mean((r_chosen + r_rejected)^2)
    reference: str | None = None  # dpo: the reference model's run or HF dir (default: the initial policy)
    precompute_reference: bool = False  # dpo: reference log-probs once, stored with the run
    # distill (TRL's GKD: --beta 0 forward KL (default), 1 reverse KL, between: generalized JSD; --temperature)
    teacher: str | None = None  # the teacher's run or HF dir: any family with the student's vocabulary
    distill_top_k: int = 0  # the divergence over the teacher's k likeliest tokens of each position (0: all)
    lmbda: float = 0.0  # on-policy GKD: the share of steps whose completions the student samples (TRL's default 0.5)
    seq_kd: bool = False  # the other steps' completions sampled by the teacher (TRL GKD's sequence-level KD)
    # grpo (TRL's GRPOConfig names and defaults)
    reward_funcs: tuple[str, ...] = ()  # FILE.py:FUNCTION, comma-separated
    reward_weights: tuple[float, ...] | None = None  # one per reward function (default: all 1)
    reward_model: str | None = None  # a reward model (run or HF *ForSequenceClassification dir), after the functions
    num_generations: int = 8  # completions sampled per prompt (a group)
    num_iterations: int = 1  # optimisation passes per batch of completions
    epsilon: float = 0.2
    epsilon_high: float | None = None  # default: epsilon (DAPO: 0.28)
    scale_rewards: str = "group"  # group | batch | none
    multi_objective_aggregation: str = "sum_then_normalize"  # or normalize_then_sum (each function's own)
    mask_truncated_completions: bool = False  # completions without an eos do not score (DAPO)
    importance_sampling_level: str = "token"  # or sequence (GSPO)
    use_bias_correction_kl: bool = True  # the KL term times the importance weight (DeepSeek-V3.2)
    delta: float | None = None  # two-sided clipping: the ratio's upper bound (INTELLECT-2)
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    top_entropy_quantile: float = 1.0  # the policy term on the top share of tokens by entropy
    entropy_coef: float = 0.0  # an entropy bonus: loss - entropy_coef * mean entropy
    # rloo (TRL's RLOOConfig names and defaults)
    normalize_advantages: bool = False  # the batch's advantages to mean 0, std 1
    reward_clip_range: tuple[float, ...] | None = None  # MIN,MAX of the summed rewards
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    # optimization
    steps: int = 200
    optimizer: str = "adamw"
    lr: float = 3e-3
    schedule: str = "cosine"
    warmup_steps: int = 20
    weight_decay: float = 0.1
    clip_norm: float = 1.0  # 0 turns clipping off
    grad_accum: int = 1
    seed: int = 0
    init_from: str | None = None
    skip_nonfinite: bool = False
    # output
    save_every: int = 100
    keep: int = 3
    restart: bool = False  # --out has metrics but no checkpoint: train it again from step 0
    eval_every: int = 100  # 0: only at the end
    eval_steps: int = 4
    log_every: int = 10
    tensorboard: bool = False
    wandb: str | None = None  # a Weights & Biases project to log to (pip install 'shardzoo[wandb]')
    # multi-host
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    distributed: bool = False
    distributed_timeout: int = 300
    heartbeat_timeout: int = 100
    # runtime
    compile_cache: str | None = None  # a directory for jax's persistent compilation cache
    xla_preset: str = "none"  # a named set of XLA_FLAGS (train/xla_flags.py), set before JAX starts
    device_memory: str | None = None  # what one device may use (default: the accelerator's limit)

    def __post_init__(self):
        positive = ("batch_size", "seq_len", "steps", "grad_accum", "keep", "eval_steps", "log_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{_flag(name)} must be at least 1, got {getattr(self, name)}")
        for name in ("save_every", "eval_every", "warmup_steps", "lora_rank"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{_flag(name)} must be 0 or more, got {getattr(self, name)}")
        check_seed(self.seed, error=ConfigError)
        if self.wandb is not None:
            import importlib.util

            if not self.wandb.strip():
                raise ConfigError("--wandb needs a project name")
            if importlib.util.find_spec("wandb") is None:
                raise ConfigError(f"--wandb {self.wandb}: the wandb package is not installed: "
                                  "pip install 'shardzoo[wandb]' (or drop --wandb)")
        self._check_distributed()
        if self.eval_fraction is not None and not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        for name in ("lr", "weight_decay", "clip_norm"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"--{_flag(name)} must be a finite number >= 0, got {value}")
        if self.task not in TASKS:
            raise ConfigError(f"--task {self.task!r}: choose one of {', '.join(t for t in TASKS if t)}")
        if self.task not in ("dpo", "kto", "grpo", "rloo"):
            tuned = [n for n in ("reference", "max_prompt_length", "max_completion_length")
                     if getattr(self, n) not in (None, False) and not (self.on_policy and n != "reference")]
            if tuned:
                raise ConfigError(f"--{_flag(tuned[0])} is a setting of --task dpo, kto, grpo or rloo")
        if self.task not in ("dpo", "kto") and self.precompute_reference:
            raise ConfigError("--precompute-reference is a setting of --task dpo or kto")
        if self.task not in ("dpo", "kto", "grpo", "rloo") and self.loss is not None:  # rloo: its own line
            raise ConfigError(f"--loss {self.loss}: a setting of --task dpo, kto or grpo")
        self._check_dpo()
        self._check_grpo()
        self._check_distill()
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
        if self.xla_preset not in XLA_PRESETS:
            raise ConfigError(f"--xla-preset {self.xla_preset!r}: choose one of {', '.join(XLA_PRESETS)}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"--schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"--batch-size {self.batch_size} is not divisible by --grad-accum {self.grad_accum}"
            )

    def _check_dpo(self) -> None:
        """The DPO and KTO loss settings: none changed from its default without its task, the losses known."""
        defaults = TrainConfig.__dataclass_fields__
        kto = [n for n in ("desirable_weight", "undesirable_weight") if getattr(self, n) != defaults[n].default]
        if self.task != "kto" and kto:
            raise ConfigError(f"--{_flag(kto[0])} is a setting of --task kto")
        if self.task != "reward" and self.center_rewards_coefficient is not None:
            raise ConfigError("--center-rewards-coefficient is a setting of --task reward")
        if self.task == "kto" and self.loss is not None and self.loss not in KTO_LOSSES:
            raise ConfigError(f"--loss {self.loss!r}: --task kto takes one of {', '.join(KTO_LOSSES)}")
        names = ("loss_weights", "ld_alpha", "f_divergence_type", "f_alpha_divergence_coef", "discopop_tau",
                 "use_weighting")
        if self.task != "dpo":
            changed = [n for n in names if getattr(self, n) != defaults[n].default]
            if changed:
                raise ConfigError(f"--{_flag(changed[0])} is a setting of --task dpo")
            return
        unknown = [x for x in (self.loss or "sigmoid").split(",") if x not in DPO_LOSSES]
        if unknown:
            raise ConfigError(f"--loss {unknown[0]!r}: --task dpo takes one or more (comma-separated) of "
                              f"{', '.join(DPO_LOSSES)}")

    @property
    def on_policy(self) -> bool:
        """``--task distill`` whose completions are sampled (``--lmbda`` > 0 or ``--seq-kd``: ``train/gkd.py``)."""
        return self.task == "distill" and (self.lmbda > 0 or self.seq_kd)

    def _check_distill(self) -> None:
        """``--task distill`` needs ``--teacher``; its settings belong to it."""
        if self.task != "distill":
            for name in ("teacher", "distill_top_k", "lmbda", "seq_kd"):
                if getattr(self, name):
                    raise ConfigError(f"--{_flag(name)} is a setting of --task distill")
            return
        if not self.teacher:
            raise ConfigError("--task distill needs --teacher DIR (the teacher's run or HF dir)")
        if self.beta is not None and not 0.0 <= self.beta <= 1.0:
            raise ConfigError(f"--beta {self.beta} must be in [0, 1] for --task distill (0: forward KL, 1: reverse)")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ConfigError(f"--temperature must be > 0, got {self.temperature}")
        if self.distill_top_k < 0:
            raise ConfigError(f"--distill-top-k must be >= 0 (0: the whole vocabulary), got {self.distill_top_k}")
        if not 0.0 <= self.lmbda <= 1.0:
            raise ConfigError(f"--lmbda must be in [0, 1] (the share of on-policy steps), got {self.lmbda}")

    def _check_grpo(self) -> None:
        """The GRPO and RLOO settings: each in range, and none changed from its default without its task."""
        defaults = TrainConfig.__dataclass_fields__
        names = ("reward_funcs", "reward_model", "reward_weights", "num_generations", "num_iterations", "epsilon", "epsilon_high",
                 "mask_truncated_completions", "temperature", "top_k", "top_p")
        only = {"grpo": ("scale_rewards", "multi_objective_aggregation") + GRPO_OPTIONS, "rloo": RLOO_OPTIONS}
        for task, settings in [(("grpo", "rloo"), names), *(((t,), n) for t, n in only.items())]:
            changed = [n for n in settings if getattr(self, n) != defaults[n].default
                       and not (self.task == "distill" and n == "temperature")  # GKD's temperature
                       and not (self.on_policy and n in ("top_k", "top_p"))]  # on-policy GKD samples
            if self.task not in task and changed:
                raise ConfigError(f"--{_flag(changed[0])} is a setting of --task {' or '.join(task)}")
        if self.task not in ("grpo", "rloo"):
            return
        if self.task == "rloo" and self.loss is not None:
            raise ConfigError(f"--loss {self.loss!r}: --task rloo has one loss (TRL's RLOOTrainer has no loss_type)")
        if self.loss is not None and self.loss not in GRPO_LOSSES:
            raise ConfigError(f"--loss {self.loss!r}: --task grpo takes one of {', '.join(GRPO_LOSSES)}")
        if self.beta is not None and not (math.isfinite(self.beta) and self.beta >= 0):
            raise ConfigError(f"--beta must be a finite number >= 0 for --task {self.task}, got {self.beta}")
        if self.importance_sampling_level not in IMPORTANCE_LEVELS:
            raise ConfigError(f"--importance-sampling-level {self.importance_sampling_level!r}: choose one of "
                              f"{', '.join(IMPORTANCE_LEVELS)}")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ConfigError(f"--top-entropy-quantile must be in [0, 1], got {self.top_entropy_quantile}")
        clip = self.reward_clip_range
        if clip is not None and (len(clip) != 2 or not clip[0] <= clip[1]):
            raise ConfigError(f"--reward-clip-range takes MIN,MAX with MIN <= MAX, got {','.join(map(str, clip))}")
        rewards = len(self.reward_funcs) + bool(self.reward_model)
        if self.reward_weights is not None and len(self.reward_weights) != rewards:
            raise ConfigError(f"--reward-weights has {len(self.reward_weights)} values for "
                              f"{len(self.reward_funcs)} --reward-funcs"
                              + (" and the --reward-model" if self.reward_model else ""))
        if self.num_generations < 2:
            raise ConfigError(f"--num-generations must be at least 2 (a group), got {self.num_generations}")
        if self.batch_size % self.num_generations:
            raise ConfigError(f"--batch-size {self.batch_size} (completions per step) is not divisible by "
                              f"--num-generations {self.num_generations}")
        if self.num_iterations < 1:
            raise ConfigError(f"--num-iterations must be at least 1, got {self.num_iterations}")
        for name in ("epsilon", "epsilon_high"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"--{_flag(name)} must be a finite number >= 0, got {value}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ConfigError(f"--scale-rewards {self.scale_rewards!r}: choose one of {', '.join(SCALE_REWARDS)}")
        if self.multi_objective_aggregation not in AGGREGATIONS:
            raise ConfigError(f"--multi-objective-aggregation {self.multi_objective_aggregation!r}: choose one of "
                              f"{', '.join(AGGREGATIONS)}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ConfigError(f"--temperature must be > 0 (GRPO samples), got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-k must be >= 0 and --top-p in (0, 1], got {self.top_k} and {self.top_p}")
        completion = self.max_completion_length
        if completion is not None and not 1 <= completion < self.seq_len:
            raise ConfigError(f"--max-completion-length {completion} must be from 1 to --seq-len - 1 "
                              f"({self.seq_len - 1}): each row holds the prompt and its completion")
        if self.precompute_reference:
            raise ConfigError(f"--precompute-reference: {self.task.upper()}'s completions are sampled while training; "
                              "the reference scores them as they come")

    def _check_distributed(self) -> None:
        """The multi-host flags, checked before anything starts (jax would abort or raise)."""
        n, i = self.num_processes, self.process_id
        if n is not None and n < 1:
            raise ConfigError(f"--num-processes must be at least 1, got {n}")
        if i is not None and (i < 0 or (n is not None and i >= n)):
            raise ConfigError(f"--process-id {i} must be from 0 to --num-processes - 1"
                              + (f" ({n - 1})" if n is not None else ""))
        if self.coordinator is not None:
            host, _, port = self.coordinator.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--coordinator {self.coordinator!r} must be HOST:PORT with a port "
                                  "from 1 to 65535 (e.g. 10.0.0.1:1234)")
        for name in ("distributed_timeout", "heartbeat_timeout"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{_flag(name)} must be at least 1 second, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def section(self, name: str) -> dict:
        """One section's settings, by field name."""
        return {k: getattr(self, k) for k in SECTIONS[name]}

    def to_sections(self) -> dict:
        """The settings nested by section (the form of run.json and --config files)."""
        return {name: self.section(name) for name in SECTIONS}


SECTIONS = {
    "model": ("model", "override", "init_from", "lora_rank", "lora_alpha", "lora_targets",
              "lora_base_dtype", "lora_from", "remat"),
    "data": ("data", "text_column", "prompt_column", "completion_column", "chat_column",
             "label_column", "feature_columns", "eval_data", "eval_fraction", "skip_missing", "max_prompt_length",
             "max_completion_length", "tokenizer", "add_bos",
             "batch_size",
             "seq_len"),
    "task": ("task", "loss", "beta", "label_smoothing", "simpo_gamma", "cpo_alpha", "loss_weights", "ld_alpha",
             "f_divergence_type", "f_alpha_divergence_coef", "discopop_tau", "use_weighting", "desirable_weight",
             "undesirable_weight", "center_rewards_coefficient", "reference",
             "precompute_reference", "teacher", "distill_top_k", "lmbda", "seq_kd", "reward_funcs", "reward_model", "reward_weights", "num_generations", "num_iterations",
             "epsilon", "epsilon_high", "scale_rewards", "multi_objective_aggregation", "mask_truncated_completions",
             "temperature", "top_k", "top_p", "importance_sampling_level", "use_bias_correction_kl", "delta",
             "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
             "vespo_lambda_neg", "top_entropy_quantile", "entropy_coef", "normalize_advantages", "reward_clip_range"),
    "optimizer": ("steps", "optimizer", "lr", "schedule", "warmup_steps", "weight_decay",
                  "clip_norm", "grad_accum", "seed", "skip_nonfinite"),
    "sharding": ("rules", "opt_rules", "mesh"),
    "checkpoint": ("out", "save_every", "keep", "restart"),
    "logging": ("log_every", "eval_every", "eval_steps", "tensorboard", "wandb"),
    "distributed": ("coordinator", "num_processes", "process_id", "distributed",
                    "distributed_timeout", "heartbeat_timeout"),
    "runtime": ("compile_cache", "xla_preset", "device_memory"),
}


HELP = {
    "out": "run directory: checkpoints/, metrics.jsonl, run.json, tokenizer/ (resumes if it has checkpoints)",
    "model": "model preset (see shardzoo.models.list_models())",
    "override": "change one field of the model config (repeatable)",
    "rules": "rule table: a preset name or a YAML/JSON file (default: fsdp on >1 device, dp on one)",
    "opt_rules": "separate rule table for the optimizer state, e.g. zero1 (default: as the params)",
    "mesh": "mesh spec like data=2,fsdp=-1 (default: every device on the first of fsdp, tensor "
            "that the rules use, else on data)",
    "data": "a file, glob, directory, 'stdlib' (the embedded standard-library corpus) or hub:NAME[:CONFIG][@SPLIT]",
    "text_column": "column holding the documents",
    "prompt_column": "fine-tuning: the prompt column (no loss); needs --completion-column",
    "completion_column": "fine-tuning: the completion column (loss)",
    "chat_column": "chat fine-tuning: a column of {role, content} message lists, rendered with the "
                   "tokenizer's chat template; loss on assistant turns only",
    "label_column": "classification/regression (an MLP): the label column; turns on labelled data",
    "feature_columns": "classification/regression: comma-separated feature columns (default: all but the label)",
    "eval_data": "held-out data spec for evaluation",
    "eval_fraction": "fraction of the documents held out for evaluation (default: 0.05 of stdlib, else 0)",
    "skip_missing": "skip rows whose text, prompt or completion is missing (null), and bad preference pairs "
                    "(empty completion, chosen = rejected), with a count; default: refuse them",
    "max_prompt_length": "--task dpo/kto/grpo: keep the last N tokens of each prompt",
    "max_completion_length": "--task dpo/kto: keep the first N tokens of each completion; --task grpo: tokens "
                             "sampled per completion (default: half --seq-len; the prompt keeps the rest)",
    "task": "what to train: the model's own task (default), lm, dpo (preference pairs: prompt/chosen/rejected), "
            "kto (unpaired rows: prompt/completion/label), grpo (prompts, sampled completions, --reward-funcs) "
            "or rloo (the same, RLOO's advantages and loss), distill (text, the --teacher's distributions: TRL's GKD)",
    "loss": "TRL's loss_type: --task dpo: sigmoid (DPO, default), hinge, ipo, exo_pair, nca_pair, robust, bco_pair, "
            "sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop, sft, sigmoid_norm (several comma-separated, "
            "weighted by --loss-weights), or simpo / orpo; --task kto: kto (default) or apo_zero_unpaired; "
            "--task grpo: dapo (default, as TRL 1.16), grpo, bnpo, dr_grpo, cispo, sapo, luspo or vespo",
    "beta": "--task dpo/kto: the loss's beta (temperature, default 0.1); --task grpo: the KL coefficient "
            "(default 0: no reference model); --task rloo: the KL penalty in the reward (default 0.05); --task distill: "
            "GKD's beta (default 0: forward KL; 1: reverse KL; between: generalized JSD)",
    "reward_funcs": "--task grpo: reward functions FILE.py:FUNCTION, comma-separated; each is called as TRL's "
                    "function(prompts, completions, completion_ids, **other_columns) -> list of floats",
    "reward_model": "--task grpo/rloo: a reward model (a --task reward run or an HF *ForSequenceClassification dir) "
                    "scoring prompt + completion as TRL does, after the --reward-funcs; sharded by the run's rules",
    "reward_weights": "--task grpo: comma-separated weights of the reward functions (default: 1 each)",
    "num_generations": "--task grpo: completions sampled per prompt; --batch-size counts completions",
    "num_iterations": "--task grpo: optimisation steps on each batch of completions (old log-probs once per batch)",
    "epsilon": "--task grpo: the ratio's clipping range 1 - epsilon",
    "epsilon_high": "--task grpo: the ratio's upper clipping 1 + epsilon-high (DAPO; default: epsilon)",
    "scale_rewards": "--task grpo: divide the group-centred rewards by the group's std (group), the batch's "
                     "(batch), or not (none, Dr. GRPO)",
    "multi_objective_aggregation": "--task grpo: sum_then_normalize (the weighted rewards' sum, normalised in its "
                                   "group) or normalize_then_sum (each function normalised in its group, the weighted "
                                   "sum normalised over the batch), as TRL",
    "mask_truncated_completions": "--task grpo: completions that reach --max-completion-length without an eos do "
                                  "not score in the loss (DAPO; they still count in their group's rewards)",
    "importance_sampling_level": "--task grpo: the ratio per token, or per completion (sequence: the mean "
                                 "log-ratio of its tokens, GSPO)",
    "use_bias_correction_kl": "--task grpo: multiply the KL term by the importance weight (TRL's default; "
                              "--no-use-bias-correction-kl: the plain k3 estimate)",
    "delta": "--task grpo: two-sided clipping: the ratio's upper bound in the clipped losses (INTELLECT-2)",
    "sapo_temperature_neg": "--loss sapo: the gate's temperature on non-positive advantages",
    "sapo_temperature_pos": "--loss sapo: the gate's temperature on positive advantages",
    "vespo_k_pos": "--loss vespo: the power k on non-negative advantages",
    "vespo_lambda_pos": "--loss vespo: the decay lambda on non-negative advantages",
    "vespo_k_neg": "--loss vespo: the power k on negative advantages",
    "vespo_lambda_neg": "--loss vespo: the decay lambda on negative advantages",
    "top_entropy_quantile": "--task grpo: the policy term on this top share of the batch's completion tokens "
                            "by entropy (1: all)",
    "entropy_coef": "--task grpo: an entropy bonus, the loss minus entropy-coef times the mean entropy",
    "normalize_advantages": "--task rloo: the batch's advantages to mean 0 and std 1",
    "reward_clip_range": "--task rloo: MIN,MAX clip of the summed rewards (before the KL penalty)",
    "temperature": "--task grpo/rloo: sampling temperature; --task distill: both distributions' softmax temperature",
    "top_k": "--task grpo: sample among the k most likely tokens (0: all)",
    "top_p": "--task grpo: sample among the most likely tokens holding top-p of the mass",
    "label_smoothing": "--task dpo: label smoothing of sigmoid, simpo (conservative DPO), aot; robust's flip "
                       "probability; exo_pair's epsilon; in [0, 0.5)",
    "simpo_gamma": "--loss simpo: the target reward margin gamma",
    "loss_weights": "--task dpo: comma-separated weights of the comma-separated --loss types (TRL's loss_weights, "
                    "MPO; default: 1 each)",
    "use_weighting": "--task dpo: WPO (TRL's use_weighting): each pair's loss times exp of its chosen and its "
                     "rejected completion's mean of log p(token) - log sum(p^2), without gradient",
    "ld_alpha": "--task dpo: LD-DPO's alpha in [0, 1]: the weight of the completion tokens past the shorter "
                "completion's length (default: none, plain sums)",
    "f_divergence_type": "--task dpo: f-DPO's regularizer: reverse_kl, forward_kl, js_divergence or alpha_divergence "
                         "(with sigmoid, sigmoid_norm, hinge, ipo, exo_pair, robust, discopop, sft)",
    "f_alpha_divergence_coef": "--f-divergence-type alpha_divergence: its alpha",
    "discopop_tau": "--loss discopop: its temperature tau",
    "desirable_weight": "--task kto: weight of the desirable rows' losses (TRL's desirable_weight)",
    "undesirable_weight": "--task kto: weight of the undesirable rows' losses (TRL's undesirable_weight)",
    "center_rewards_coefficient": "--task reward: weight of mean((r_chosen + r_rejected)^2), TRL's "
                                  "center_rewards_coefficient (default: none)",
    "cpo_alpha": "--loss simpo: weight of the NLL of the chosen completions (TRL's cpo_alpha)",
    "reference": "--task dpo/kto: the reference model (a run, a checkpoint or an HF dir); default: the initial "
                 "policy (with LoRA: the base, adapters off, no second copy)",
    "teacher": "--task distill: the teacher (a run, a checkpoint or an HF dir; any family with the student's "
               "vocabulary)",
    "lmbda": "--task distill: on-policy GKD, the share of steps whose completions the student samples from the "
             "prompts (TRL's lmbda; > 0 reads prompt/completion rows; 0, the default: the off-policy lm data path)",
    "seq_kd": "--task distill: the steps not on-policy train on completions the teacher samples (TRL GKD's seq_kd)",
    "distill_top_k": "--task distill: the divergence over the teacher's K likeliest tokens per position "
                     "(default 0: the whole vocabulary)",
    "precompute_reference": "--task dpo/kto: compute the reference log-probs once before training and store them "
                            "with the run (OUT/reference_logps*.npy); no reference model while training",
    "tokenizer": "byte, a tokenizer.json or a Hugging Face model dir",
    "add_bos": "start every document with bos",
    "batch_size": "global batch size in sequences (all devices, all microbatches)",
    "seq_len": "tokens per sequence",
    "steps": "total optimizer steps of the run (a resumed run continues up to it)",
    "optimizer": "optimizer",
    "lr": "peak learning rate",
    "schedule": "learning-rate schedule after the linear warmup",
    "warmup_steps": "linear warmup steps from 0 to --lr",
    "weight_decay": "weight decay of kernels and embeddings, not norms or biases (decoupled in adamw)",
    "clip_norm": "clip gradients to this global norm (0: off)",
    "grad_accum": "microbatches per step (gradient accumulation)",
    "seed": "random seed of init and dropout",
    "init_from": "initialize params from a shardzoo run or checkpoint dir, an HF model dir or a Hub "
                 "model id ORG/NAME[@REVISION]",
    "lora_rank": "LoRA: train rank-R adapters on the frozen base (0: full fine-tuning)",
    "lora_alpha": "LoRA: the adapters' scale is alpha / rank (default: alpha = rank)",
    "lora_targets": "LoRA: comma-separated projections to adapt, among q,k,v,o,gate,up,down and latent "
                    "attention's q_a,q_b,kv_a,kv_b (default: every one the model has, PEFT's all-linear)",
    "lora_base_dtype": "LoRA: param dtype of the frozen base (e.g. bfloat16); adapters stay float32",
    "lora_from": "LoRA: start the adapters from a PEFT adapter dir (rank, alpha, targets from it); needs --init-from",
    "skip_nonfinite": "skip steps whose loss or gradient is NaN/Inf (and count them) instead of stopping",
    "save_every": "checkpoint every N steps (0: only at the end)",
    "keep": "checkpoints to keep",
    "restart": "train an --out that has metrics but no checkpoint again from step 0, its metrics.jsonl "
               "started over; without it that file is kept as metrics.jsonl.orphaned-TIME. A run with a "
               "checkpoint resumes as usual",
    "eval_every": "evaluate every N steps (0: only at the end)",
    "eval_steps": "batches per periodic evaluation (the final one scores the whole eval split)",
    "log_every": "log metrics every N steps",
    "tensorboard": "also write TensorBoard event files to OUT/tensorboard",
    "wandb": "also log the metrics to this Weights & Biases project (pip install 'shardzoo[wandb]'; "
             "WANDB_MODE=offline keeps them in OUT/wandb for `wandb sync`)",
    "coordinator": "multi-host: coordinator address HOST:PORT for jax.distributed.initialize",
    "num_processes": "multi-host: number of processes",
    "process_id": "multi-host: this process's id",
    "distributed": "multi-host: call jax.distributed.initialize() with cluster auto-detection",
    "distributed_timeout": "multi-host: seconds to wait for every process to join before failing",
    "heartbeat_timeout": "multi-host: seconds without a peer's heartbeat before every process stops",
    "remat": "the remat policy of the train step: auto (the fastest of none, dots_with_no_batch_dims_saveable, "
             "save_attn_mlp, full whose compiled step fits the device's memory; the run records the one chosen) "
             "or one of them (default: auto on a TPU or GPU, the model's own, none, on CPU)",
    "device_memory": "the memory one device may use, e.g. 16GB, 80GiB, or h100, v5e: the compiled train step "
                     "must fit it (and --remat auto chooses by it); default: the accelerator's own limit, "
                     "none on CPU",
    "compile_cache": "a directory for jax's persistent compilation cache (reused by later runs)",
    "xla_preset": "a named set of XLA flags added to XLA_FLAGS before JAX starts: "
                  + "; ".join(f"{k}: {v}" for k, v in XLA_PRESET_HELP.items()),
}
METAVARS = {"remat": "auto|POLICY", "device_memory": "SIZE|DEVICE", "reward_funcs": "FILE.py:FN,...", "reward_clip_range": "MIN,MAX", "reward_weights": "W,...", "reward_model": "DIR", "wandb": "PROJECT", "reference": "DIR", "teacher": "DIR", "distill_top_k": "K", "max_prompt_length": "N", "max_completion_length": "N", "chat_column": "COLUMN", "out": "DIR", "compile_cache": "DIR", "feature_columns": "COL,COL,...", "model": "NAME", "override": "KEY=VALUE", "rules": "NAME|FILE",
            "opt_rules": "NAME|FILE", "mesh": "SPEC", "data": "SPEC", "tokenizer": "byte|PATH",
            "init_from": "DIR", "coordinator": "HOST:PORT", "lora_rank": "R", "lora_alpha": "A",
            "lora_targets": "q,k,v,...", "lora_base_dtype": "DTYPE", "lora_from": "ADAPTER_DIR"}


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _field_type(name: str):
    tp = typing.get_type_hints(TrainConfig)[name]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def add_arguments(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """The ``shardzoo train`` flags, one per TrainConfig field (``only``: those fields), plus --config."""
    p.add_argument("--config", metavar="FILE", help="YAML file with any of the settings below (flags win)")
    defaults = TrainConfig()
    for field in dataclasses.fields(TrainConfig):
        if only is not None and field.name not in only:
            continue
        name, tp = field.name, _field_type(field.name)
        group = p
        kw = {"dest": name, "default": argparse.SUPPRESS}
        default = getattr(defaults, name)
        help_text = HELP[name] + ("" if default in (None, (), False) else f" (default: {default})")
        if tp is bool:  # on by default: --no-NAME turns it off
            action = argparse.BooleanOptionalAction if default else "store_true"
            group.add_argument(f"--{_flag(name)}", action=action, help=help_text, **kw)
        elif name == "override":
            group.add_argument("--override", action="append", metavar=METAVARS[name], help=help_text, **kw)
        elif typing.get_origin(tp) is tuple:  # a comma-separated list, coerced with the rest
            group.add_argument(f"--{_flag(name)}", help=help_text, metavar=METAVARS.get(name), **kw)
        else:
            choices = {"optimizer": OPTIMIZERS, "schedule": SCHEDULES, "task": TASKS[1:],
                       "scale_rewards": SCALE_REWARDS,
                       "importance_sampling_level": IMPORTANCE_LEVELS,
                       "multi_objective_aggregation": AGGREGATIONS}.get(name)
            group.add_argument(f"--{_flag(name)}", type=tp, choices=choices, help=help_text,
                               metavar=METAVARS.get(name), **kw)


def _load_yaml(path: str) -> dict:
    """The settings of a ``--config`` file, sectioned (as run.json) or flat, coerced."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: cannot parse: {str(e).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of settings, got {type(data).__name__}")
    flat = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            for name, v in value.items():
                name = str(name).replace("-", "_")
                if name not in SECTIONS[key]:
                    raise ConfigError(f"--config {path}: unknown setting {name!r} in section {key!r}; "
                                      f"it has {', '.join(SECTIONS[key])}")
                flat[name] = (f"{key}.{name}", v)
        else:
            flat[str(key).replace("-", "_")] = (str(key), value)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    out = {}
    for name, (key, value) in flat.items():
        if name not in fields:
            raise ConfigError(f"--config {path}: unknown setting {key!r}")
        out[name] = _coerce(name, value, f"--config {path}: {key}")
    return out


def _coerce(name: str, value, where: str):
    if name == "override":  # a list of KEY=VALUE strings, or a mapping of them
        if isinstance(value, dict):
            value = [f"{k}={v}" for k, v in value.items()]
        elif isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of KEY=VALUE strings")
        return tuple(value)
    return coerce(value, typing.get_type_hints(TrainConfig)[name], where, ConfigError)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's TrainConfig from parsed flags (and the --config file they name)."""
    given = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("command",)}
    values = _load_yaml(given.pop("config")) if given.get("config") else {}
    given.pop("config", None)
    if "override" in given:  # YAML overrides first, flags after: the last value of a key wins
        given["override"] = tuple(values.get("override", ())) + tuple(given["override"])
    values.update({k: _coerce(k, v, f"--{_flag(k)}") if isinstance(v, str) and k != "override" else v
                   for k, v in given.items()})
    try:
        return TrainConfig(**values)
    except TypeError as e:
        raise ConfigError(str(e)) from None

