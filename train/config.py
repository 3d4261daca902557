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

import dataclasses
import math

from shardzoo.errors import ConfigError
from shardzoo.train.tasks.settings import OWNED, TASK_SETTINGS, TASKS, owners, said
from shardzoo.train.xla_flags import XLA_PRESETS
from shardzoo.values import check_seed

OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "lion")
SCHEDULES = ("cosine", "linear", "constant")
NONFINITE_EXIT = 3  # exit status of a run stopped by a NaN/Inf loss or gradient


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
                raise ConfigError(f"--{flag(name)} must be at least 1, got {getattr(self, name)}")
        for name in ("save_every", "eval_every", "warmup_steps", "lora_rank"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{flag(name)} must be 0 or more, got {getattr(self, name)}")
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
                raise ConfigError(f"--{flag(name)} must be a finite number >= 0, got {value}")
        if self.task not in TASK_SETTINGS:
            raise ConfigError(f"--task {self.task!r}: choose one of {', '.join(t for t in TASKS if t)}")
        task, defaults = TASK_SETTINGS[self.task], TrainConfig.__dataclass_fields__
        for name in OWNED:  # the task-only settings: refused changed by a task that does not take them
            if not task.takes(name, self) and getattr(self, name) != defaults[name].default:
                raise ConfigError(f"--{flag(name)} is a setting of --task {said(owners(name))}")
        task.check(self)  # its own settings' values (tasks/settings.py)
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

    @property
    def on_policy(self) -> bool:
        """Whether the run samples its completions as on-policy distillation does (``train/tasks/gkd.py``)."""
        return TASK_SETTINGS[self.task].on_policy(self)

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
                raise ConfigError(f"--{flag(name)} must be at least 1 second, got {getattr(self, name)}")

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


def flag(name: str) -> str:
    """A setting's command-line flag name (``--NAME`` with dashes)."""
    return name.replace("_", "-")
