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
import math
import os

import jax
import numpy as np
from flax import traverse_util

from shardzoo.errors import UserError
from shardzoo.models import apply_overrides, hf
from shardzoo.models.hf.tensors import _layer_weights, put_leaf
from shardzoo.models.lora import TARGETS, is_adapter, join, lora_scale, split
from shardzoo.train import model_info
from shardzoo.train.config import ConfigError
from shardzoo.train.defaults import mesh_and_rules
from shardzoo.train.rundir import check_empty_target
from shardzoo.train.sources import ADAPTER_CONFIG as CONFIG_FILE
from shardzoo.train.sources import ADAPTER_WEIGHTS as WEIGHTS_FILE
from shardzoo.train.sources import READS_RUNS, load_model, open_source

PREFIX = "base_model.model."


class AdapterError(UserError):
    """A PEFT adapter dir that shardzoo cannot read, or a model it cannot export one for."""


# ------------------------------------------------------------------------------- the model
def with_lora(cfg, config):
    """The model config a run trains: ``config`` with the run's LoRA settings (from the flags,
    or the adapter dir of ``--lora-from``), and ``--lora-base-dtype`` as the base's dtype."""
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
    fields = dict(lora_rank=rank, lora_alpha=alpha, lora_targets=targets)
    if cfg.lora_base_dtype:
        fields["param_dtype"] = cfg.lora_base_dtype
    return apply_overrides(config, fields, where="--lora-*")


def _as_list(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _adapter_source(path: str):
    return open_source(path, what="--lora-from", accept=("adapter",))


def initial_params(cfg, target, config, mesh, rules, family=None):
    """``--init-from``'s params for ``target``: the base from the run or HF dir, and the adapters
    from ``--lora-from`` when given, or from a LoRA run's checkpoint with the same rank and
    targets (else they are left to the program's random init)."""
    source = open_source(cfg.init_from, what="--init-from")
    if not model_info.lora_rank(config) or _same_adapters(cfg, config, source):
        return source.load_params(target, config)
    adapters, base = split(target, is_adapter)
    params = source.load_params(base, config)
    if cfg.lora_from:
        params = join(_adapter_source(cfg.lora_from).load_params(adapters, config, family), params)
    return params


def _same_adapters(cfg, config, source) -> bool:
    """Whether ``--init-from`` is a LoRA run with the adapters ``config`` asks for (rank and
    targets): then they continue from its checkpoint, with its base."""
    if cfg.lora_from or source.kind == "hf":
        return False
    return model_info.lora_adapters(source.config) == model_info.lora_adapters(config)


# ------------------------------------------------------------------------- PEFT names
def _modules(config, family) -> list[tuple[tuple, tuple[int, ...], bool, str, str]]:
    """``(leaf path without its last name, model layers, stacked, target, HF module)`` of each
    adapted projection, from the family's weight map and the config's ``param_layout`` (a
    stacked leaf holds its layers on a leading axis in that order)."""
    fam = hf.family_of_config(config.replace(lora_rank=0), family)
    _, groups = _layer_weights(config, fam)
    out = []
    for prefix, layers, stacked, weights in groups:
        by_path = {w.path: w for w in weights}
        for t in config.lora_targets:
            owner = "mlp" if t in ("gate", "up", "down") else "attn"
            w = by_path.get((owner, t, "kernel"))
            if w is None or w.op != "linear" or w.part != (0, 1) or not w.name.endswith(".weight"):
                where = "no HF tensor" if w is None else f"HF tensor {w.name} (fused or not a Linear)"
                raise AdapterError(f"family {fam.name} stores projection {t!r} as {where}: "
                                   f"PEFT adapters cover separate q/k/v/o/gate/up/down Linears only")
            out.append((prefix + w.path[:-1], layers, stacked, t, w.name.removesuffix(".weight")))
    return out


# ----------------------------------------------------------------------------- import
def load_adapters(path: str, target, config, family=None):
    """The adapters of a PEFT dir, placed like ``target`` (the adapter leaves' ShapeDtypeStructs)."""
    from safetensors import safe_open

    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        raise AdapterError(f"--lora-from {path}: no {WEIGHTS_FILE}")
    flat = traverse_util.flatten_dict(target)
    out = {}
    with safe_open(weights, framework="np") as f:
        stored = set(f.keys())

        def tensor(name, shape):
            if name not in stored:
                raise AdapterError(f"{weights}: no tensor {name!r}")
            t = f.get_tensor(name)
            if tuple(t.shape) != shape:
                raise AdapterError(f"{weights}: tensor {name!r} has shape {list(t.shape)}, the "
                                   f"model wants {list(shape)}")
            return t

        for path_, layers, stacked, _, module in _modules(config, family):
            for leaf_name, letter in (("lora_a", "A"), ("lora_b", "B")):
                leaf = flat[path_ + (leaf_name,)]
                per_layer = leaf.shape[1:] if stacked else leaf.shape
                rank = per_layer[-1] if letter == "A" else per_layer[0]
                other = math.prod(per_layer) // rank
                shape = (rank, other) if letter == "A" else (other, rank)

                def read(k, module=module, letter=letter, shape=shape, per_layer=per_layer, layers=layers):
                    name = f"{PREFIX}{module.replace('{i}', str(layers[k]))}.lora_{letter}.weight"
                    return tensor(name, shape).T.reshape(per_layer)

                if stacked:
                    out[path_ + (leaf_name,)] = put_leaf(leaf.shape, leaf.dtype, leaf.sharding, read,
                                                         leaf.shape[0])
                else:
                    out[path_ + (leaf_name,)] = put_leaf(leaf.shape, leaf.dtype, leaf.sharding,
                                                         lambda read=read: read(0))
    return traverse_util.unflatten_dict(out)


# ----------------------------------------------------------------------------- export
def export_lora(checkpoint_dir: str, out_dir: str, mesh, rules, step: int | None = None,
                base: str | None = None, overwrite: bool = False) -> dict:
    """Write a LoRA run's adapters as a PEFT adapter dir; returns its adapter_config."""
    from safetensors.numpy import save_file

    from shardzoo.train.hf_io import _locked

    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    check_empty_target(out_dir, "OUT_DIR", overwrite)
    source = open_source(checkpoint_dir, step=step, what="CHECKPOINT_DIR", accept=READS_RUNS)
    _, config, params = load_model(source, *mesh_and_rules(mesh, rules))
    if not model_info.lora_rank(config):
        raise AdapterError(f"{checkpoint_dir} has no LoRA adapters (a run trained with --lora-rank has)")
    family = source.family  # of the step the params came from (the readers' rule)
    flat = traverse_util.flatten_dict(params)
    tensors, modules = {}, []
    for path_, layers, stacked, t, module in _modules(config, family):
        a, b = (np.asarray(_host(flat[path_ + (n,)]), np.float32) for n in ("lora_a", "lora_b"))
        for k, j in enumerate(layers):
            aj, bj = (a[k], b[k]) if stacked else (a, b)
            name = PREFIX + module.replace("{i}", str(j))
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(aj.reshape(-1, config.lora_rank).T)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(bj.reshape(config.lora_rank, -1).T)
        modules.append(f"{t}_proj")
    conf = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.lora_rank,
        "lora_alpha": lora_scale(config) * config.lora_rank, "lora_dropout": 0.0,
        "target_modules": sorted(set(modules)), "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "base_model_name_or_path": base or source.lora_base,
    }
    with _locked(out_dir, "OUT_DIR"):
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
