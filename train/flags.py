"""The ``shardzoo train`` flags and ``--config FILE``: one flag per TrainConfig field (its name),
its help and metavar, and the YAML reader; every value through the one coercer."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from shardzoo.models.execution import AUTO_REMAT
from shardzoo.train.config import (
    OPTIMIZERS,
    SCHEDULES,
    SECTIONS,
    ConfigError,
    TrainConfig,
    flag,
)
from shardzoo.train.tasks.settings import AGGREGATIONS, IMPORTANCE_LEVELS, SCALE_REWARDS, TASKS
from shardzoo.train.xla_flags import XLA_PRESET_HELP
from shardzoo.values import coerce

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
    "remat": f"the remat policy of the train step: auto (the fastest of {', '.join(AUTO_REMAT)} whose compiled "
             "step fits the device's memory; the run records the one chosen) "
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
            group.add_argument(f"--{flag(name)}", action=action, help=help_text, **kw)
        elif name == "override":
            group.add_argument("--override", action="append", metavar=METAVARS[name], help=help_text, **kw)
        elif typing.get_origin(tp) is tuple:  # a comma-separated list, coerced with the rest
            group.add_argument(f"--{flag(name)}", help=help_text, metavar=METAVARS.get(name), **kw)
        else:
            choices = {"optimizer": OPTIMIZERS, "schedule": SCHEDULES, "task": TASKS[1:],
                       "scale_rewards": SCALE_REWARDS,
                       "importance_sampling_level": IMPORTANCE_LEVELS,
                       "multi_objective_aggregation": AGGREGATIONS}.get(name)
            group.add_argument(f"--{flag(name)}", type=tp, choices=choices, help=help_text,
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


# settings whose string "none" is one of their values (a remat policy), not a missing value
NONE_IS_A_VALUE = frozenset({"remat"})


def _coerce(name: str, value, where: str):
    if name == "override":  # a list of KEY=VALUE strings, or a mapping of them
        if isinstance(value, dict):
            value = [f"{k}={v}" for k, v in value.items()]
        elif isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of KEY=VALUE strings")
        return tuple(value)
    if name in NONE_IS_A_VALUE and isinstance(value, str) and value.strip().lower() == "none":
        return "none"  # --remat none: the policy that saves everything, not "not given" (which is auto)
    return coerce(value, typing.get_type_hints(TrainConfig)[name], where, ConfigError)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's TrainConfig from parsed flags (and the --config file they name)."""
    given = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("command",)}
    values = _load_yaml(given.pop("config")) if given.get("config") else {}
    given.pop("config", None)
    if "override" in given:  # YAML overrides first, flags after: the last value of a key wins
        given["override"] = tuple(values.get("override", ())) + tuple(given["override"])
    values.update({k: _coerce(k, v, f"--{flag(k)}") if isinstance(v, str) and k != "override" else v
                   for k, v in given.items()})
    try:
        return TrainConfig(**values)
    except TypeError as e:
        raise ConfigError(str(e)) from None

