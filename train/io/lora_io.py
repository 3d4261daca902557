"""LoRA runs: the model a run adapts, its starting params, and PEFT adapter dirs both ways.

A PEFT adapter dir holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules`` as
HF module names, ``base_model_name_or_path``) and ``adapter_model.safetensors`` with keys
``base_model.model.<HF module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``
(``peft.PeftModel.from_pretrained`` loads it onto the transformers base model). The HF module
of each adapted projection comes from the family's weight map (``model.layers.{i}.self_attn.
q_proj`` for Llama's ``attn/q/kernel``), so every family whose projections are separate
``nn.Linear``s exports and imports; fused ones (Phi-3, GPT-2) are refused in one line.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from flax import traverse_util

from shardzoo.errors import UserError
from shardzoo.models import apply_overrides, hf
from shardzoo.models.hf.tensors import _layer_weights
from shardzoo.models.lora import TARGETS, is_adapter, join, lora_scale, split, target_of
from shardzoo.train import model_info
from shardzoo.train.config import ConfigError
from shardzoo.train.defaults import mesh_and_rules
from shardzoo.train.io.peft import ADAPTER_CONFIG as CONFIG_FILE
from shardzoo.train.io.peft import ADAPTER_WEIGHTS as WEIGHTS_FILE
from shardzoo.train.io.peft import PREFIX, AdapterError, adapted_modules, peft_linear
from shardzoo.train.io.rundir import check_empty_target, locked
from shardzoo.train.io.sources import READS_RUNS, load_model, open_source


# ------------------------------------------------------------------------------- the model
def with_lora(cfg, config, family=None):
    """The model config a run trains: ``config`` with the run's LoRA settings (from the flags,
    or the adapter dir of ``--lora-from``), and ``--lora-base-dtype`` as the base's dtype.
    ``--lora-targets`` by default: every projection the model has that ``family`` (default: the
    first that expresses it) can export (PEFT's all-linear); named ones must be there."""
    if not cfg.lora_rank and not cfg.lora_from:
        return config
    if not model_info.has_lora(config):
        raise ConfigError(f"--lora-rank: {type(config).__name__} has no LoRA adapters (Transformer models have)")
    rank, alpha, targets = cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets
    if cfg.lora_from:
        if not cfg.init_from:
            raise ConfigError("--lora-from needs --init-from: the base model the adapters were trained on")
        conf = _adapter_source(cfg.lora_from).config
        names = {f"{t}_proj": t for t in TARGETS}
        modules = [m.rsplit(".", 1)[-1] for m in _as_list(conf.get("target_modules"))]
        unknown = [m for m in modules if m not in names]
        if unknown:
            raise AdapterError(f"--lora-from {cfg.lora_from}: target_modules {', '.join(unknown)} are "
                               f"not among {', '.join(names)}")
        if rank not in (0, conf["r"]):
            raise ConfigError(f"--lora-rank {rank}, but --lora-from {cfg.lora_from} has r={conf['r']}")
        rank, alpha = conf["r"], float(conf.get("lora_alpha", 8))
        targets = tuple(t for t in TARGETS if f"{t}_proj" in modules)
    fields = dict(lora_rank=rank, lora_alpha=alpha, lora_targets=TARGETS if targets is None else targets)
    if cfg.lora_base_dtype:
        fields["param_dtype"] = cfg.lora_base_dtype
    adapted = apply_overrides(config, fields, where="--lora-*")
    return adapted.replace(lora_targets=_checked_targets(adapted, family, targets is None))


def _checked_targets(config, family, default: bool) -> tuple[str, ...]:
    """The targets the model has: by default every one that ``export-lora`` can write (all it has
    where it can write none: GPT-2's Conv1D), else the asked ones, each of which must be there
    (a ConfigError naming it)."""
    fam = _family(config, family)
    _, targets = model_info.lora_adapters(config)
    if fam is None:
        return targets
    found = _found(config, fam)
    missing = [t for t in targets if t not in found]
    if missing and not default:
        have = ",".join(t for t in TARGETS if t in found)
        raise ConfigError(f"--lora-targets {missing[0]}: {fam.name} has no such projection; its projections: {have}")
    present = [t for t in targets if t in found]
    written = [t for t in present if all(map(peft_linear, found[t]))]
    return tuple(written if default and written else present)


def _found(config, fam) -> dict:
    """target -> the family's weights it adapts."""
    found = {}
    for w in _linears(config, fam):
        found.setdefault(target_of(w.path[-2]), []).append(w)
    return found


def lora_lines(config, family=None) -> list[str]:
    """What a LoRA run adapts and what it does not, for the run's first lines."""
    fam = _family(config, family)
    found = {} if fam is None else _found(config, fam)
    rank, targets = model_info.lora_adapters(config)
    where = {t: "/".join(sorted({".".join(w.path[:-2]) for w in ws})) for t, ws in found.items()}
    adapted = ", ".join(f"{t} ({where[t]})" if t in where else t for t in targets)
    left = [t for t in found if t not in targets]
    lines = [f"LoRA rank {rank}: adapts {adapted}",
             "LoRA: not adapted: " + ", ".join(left + ["routed experts and routers", "embeddings and lm head",
                                                      "norms"])]
    fused = [f"{t} ({found[t][0].name})" for t in targets
             if t in found and not all(map(peft_linear, found[t]))]
    if fused:
        lines.append(f"LoRA: export-lora cannot write {', '.join(fused)} (not one Linear in {fam.name}); "
                     "export-hf --merge-lora merges them into the weights")
    return lines


def _family(config, family):
    try:
        return hf.family_of_config(config.replace(lora_rank=0), family)
    except hf.HFError:
        return None


def _linears(config, fam) -> list:
    """The family's weights that are kernels of Linears a LoRA target adapts (one per layer kind)."""
    _, groups = _layer_weights(config, fam)
    return [w for _, _, _, ws in groups for w in ws
            if len(w.path) >= 2 and w.path[-1] == "kernel" and target_of(w.path[-2]) in TARGETS]


def _as_list(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _adapter_source(path: str):
    return open_source(path, what="--lora-from", accept=("adapter",))


def initial_params(cfg, target, config, mesh, rules, family=None):
    """``--init-from``'s params for ``target``: the base from the run or HF dir, and the adapters
    from ``--lora-from`` when given, or from a LoRA run's checkpoint with the same rank and
    targets (else they are left to the program's random init)."""
    source = open_source(cfg.init_from, what="--init-from")
    if getattr(config.arch, "score_head", False) and not getattr(source.config.arch, "score_head", False):
        return lm_params_for_reward(source, target, config)
    if not model_info.lora_rank(config) or _same_adapters(cfg, config, source):
        return source.load_params(target, config)
    adapters, base = split(target, is_adapter)
    params = source.load_params(base, config)
    if cfg.lora_from:
        params = join(_adapter_source(cfg.lora_from).load_params(adapters, config, family), params)
    return params


def lm_params_for_reward(source, target, config):
    """A causal LM's params for its reward model (``--task reward`` from an LM, as transformers'
    ``*ForSequenceClassification`` of it): all but the LM head, read as the LM's; the ``score``
    head is left to the program's random init."""
    from jax.sharding import NamedSharding, PartitionSpec

    lm = config.replace(score_head=False)
    base = {k: v for k, v in target.items() if k != "score"}
    if lm.arch.lm_head_bias:
        raise UserError(f"--init-from {source.path}: a reward model from an LM whose head has a bias is not "
                        "supported; start from a *ForSequenceClassification dir")
    if not lm.arch.tie_word_embeddings:
        embedding = target["embed"]["embedding"]  # [vocab, embed]: the head is its transpose
        spec = tuple(embedding.sharding.spec) + (None,) * (2 - len(embedding.sharding.spec))
        sharding = NamedSharding(embedding.sharding.mesh, PartitionSpec(spec[1], spec[0]))
        base["lm_head"] = {"kernel": jax.ShapeDtypeStruct(embedding.shape[::-1], embedding.dtype, sharding=sharding)}
    params = source.load_params(base, lm)
    params.pop("lm_head", None)
    return params


def _same_adapters(cfg, config, source) -> bool:
    """Whether ``--init-from`` is a LoRA run with the adapters ``config`` asks for (rank and
    targets): then they continue from its checkpoint, with its base."""
    if cfg.lora_from or source.kind == "hf":
        return False
    return model_info.lora_adapters(source.config) == model_info.lora_adapters(config)


# ----------------------------------------------------------------------------- export
def export_lora(checkpoint_dir: str, out_dir: str, mesh, rules, step: int | None = None,
                base: str | None = None, overwrite: bool = False) -> dict:
    """Write a LoRA run's adapters as a PEFT adapter dir; returns its adapter_config."""
    from safetensors.numpy import save_file

    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    check_empty_target(out_dir, "OUT_DIR", overwrite)
    source = open_source(checkpoint_dir, step=step, what="CHECKPOINT_DIR", accept=READS_RUNS)
    _, config, params = load_model(source, *mesh_and_rules(mesh, rules))
    rank = model_info.lora_rank(config)
    if not rank:
        raise AdapterError(f"{checkpoint_dir} has no LoRA adapters (a run trained with --lora-rank has)")
    family = source.family  # of the step the params came from (the readers' rule)
    flat = traverse_util.flatten_dict(params)
    tensors, modules, parts = {}, set(), {}
    for path_, layers, stacked, _, module, part in adapted_modules(config, family):
        a, b = (np.asarray(_host(flat[path_ + (n,)]), np.float32) for n in ("lora_a", "lora_b"))
        for k, j in enumerate(layers):
            aj, bj = (a[k], b[k]) if stacked else (a, b)
            name = PREFIX + module.replace("{i}", str(j))
            parts.setdefault(name, {})[part] = (aj.reshape(-1, rank).T, bj.reshape(rank, -1).T)
        modules.add(module.rsplit(".", 1)[-1])
    rank_pattern = {}
    for name, blocks in parts.items():
        ordered = [blocks[k] for k in sorted(blocks)]
        # n blocks of one HF Linear: one adapter of rank n * r, A stacked, B block-diagonal
        a_all = np.concatenate([a for a, _ in ordered], axis=0)
        b_all = np.zeros((sum(b.shape[0] for _, b in ordered), a_all.shape[0]), np.float32)
        row = 0
        for k, (_, b) in enumerate(ordered):
            b_all[row:row + b.shape[0], k * rank:(k + 1) * rank] = b
            row += b.shape[0]
        tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a_all)
        tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b_all)
        if len(ordered) > 1:
            rank_pattern[name.rsplit(".", 1)[-1]] = len(ordered)
    alpha = lora_scale(config) * rank
    conf = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
        "lora_alpha": alpha, "lora_dropout": 0.0,
        # a fused Linear's adapter: rank and alpha n times (the same alpha / r)
        "rank_pattern": {m: n * rank for m, n in rank_pattern.items()},
        "alpha_pattern": {m: n * alpha for m, n in rank_pattern.items()},
        "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "base_model_name_or_path": base or source.lora_base,
    }
    with locked(out_dir, "OUT_DIR"):
        check_empty_target(out_dir, "OUT_DIR", overwrite)
        if jax.process_index() == 0:
            try:
                os.makedirs(out_dir, exist_ok=True)
                save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
                with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
                    json.dump(conf, f, indent=2)
            except OSError as e:
                raise UserError(f"OUT_DIR {out_dir}: cannot write {e.filename or ''}: {e.strerror}") from None
    return conf


def _host(x):
    from shardzoo.models.hf.tensors import _to_host

    return _to_host(x)
