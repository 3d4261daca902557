"""What a checkpoint records of its run and model, and how the model config is rebuilt from it.

Every step's ``meta`` (JSON, beside the arrays) holds ``model`` (the zoo preset the run started
from, or None), ``family`` (the Hugging Face family whose config class rebuilds the config),
``config`` (the whole model config), and the run's ``rules``, ``mesh``, ``tokenizer``,
``optimizer``, ``seq_len``, ``batch_size`` (and ``lora`` for a LoRA run). The functions here are
the only ones that turn a model config into that record and back.
"""

from __future__ import annotations

import os

from shardzoo.errors import UserError
from shardzoo.models import ModelError, get_config
from shardzoo.train.io.checkpoint import CheckpointError, jsonable


def hf_module():
    """``shardzoo.models.hf`` (None when this shardzoo has no Hugging Face families)."""
    try:
        from shardzoo.models import hf
    except ImportError:
        return None
    return hf if hasattr(hf, "is_hf_dir") else None


def config_to_dict(config) -> dict:
    """What a checkpoint records of a model config: its two records (``{"arch", "execution"}``),
    the scan layout resolved, so a later version that chooses layouts otherwise still loads the
    params as written."""
    return jsonable(config.resolved().to_dict())


def model_meta(config, model: str | None = None, family: str | None = None, hf_config: dict | None = None) -> dict:
    """What a checkpoint records of its model: ``model``, the zoo preset the run started from
    (None when it started from an HF dir or a run that had none), ``family``, the Hugging Face
    family whose config class rebuilds it (default: the first that expresses ``config``; None
    if none does), and the whole ``config``; ``hf_config``: the config.json it was imported from,
    whose fields beyond the architecture an export writes back."""
    hf = hf_module()
    if family is None and hf is not None:
        try:
            family = hf.family_of_config(config).name
        except hf.HFError:
            family = None
    meta = {"model": model, "family": family, "config": config_to_dict(config)}
    return meta | ({"hf_config": hf_config} if hf_config else {})


def config_from_meta(meta: dict, where: str = "the checkpoint"):
    """The model config a checkpoint was written with: a Transformer's for a checkpoint that
    records a Hugging Face family, else the config class of its zoo preset ``model``; from the
    stored records, or from the flat dict of a checkpoint written before the records split
    (``ModelConfig.from_dict`` upgrades it)."""
    from shardzoo.models.transformer import TransformerConfig

    stored = dict(meta.get("config") or {})
    name = meta.get("family")
    if name is not None:
        hf = hf_module()
        if hf is None or hf.family_named(name) is None:
            raise CheckpointError(f"{where} records model family {name!r}, which this shardzoo "
                                  f"does not know")
        kind, what = TransformerConfig, f"its {name} config"
    elif meta.get("model") is None:
        raise CheckpointError(f"{where} records neither a model family nor a zoo preset")
    else:
        kind, what = type(get_config(meta["model"])), f"model {meta['model']!r}"
    try:
        return kind.from_dict(stored)
    except ModelError as e:
        raise CheckpointError(f"{where}: {what}: {e}") from None


def _resolved_dict(meta: dict) -> dict:
    """The stored config as ``config_to_dict`` writes it today (older flat dicts upgraded)."""
    try:
        return config_to_dict(config_from_meta(meta))
    except UserError:
        return meta.get("config") or {}


def _flat(records: dict) -> dict:
    return {**records.get("arch", {}), **records.get("execution", {})} if "arch" in records else records


# How a step runs, not what it computes: a resume may change it (e.g. --remat full where the
# step no longer fits), and its new checkpoints record the new value.
RESUMABLE_CHANGES = ("remat_policy",)


def recorded_remat(meta: dict) -> str | None:
    """The remat policy a checkpoint's model config records (None: it records none)."""
    return _flat(meta.get("config") or {}).get("remat_policy")


def check_same_model(meta: dict, model: str | None, config: dict, optimizer: str, where: str) -> None:
    """A resumed run must ask for the model config and optimizer its checkpoint holds."""
    saved_model = meta.get("model")
    if model is not None and saved_model is not None and saved_model != model:
        raise CheckpointError(
            f"{where} holds model {saved_model!r}, not {model!r}: use another --out or --model {saved_model}"
        )
    saved, new = _flat(_resolved_dict(meta)), _flat(jsonable(config))
    diff = [k for k in sorted(set(saved) | set(new)) if saved.get(k) != new.get(k) and k not in RESUMABLE_CHANGES]
    if diff:
        had = ", ".join(f"{k}={saved.get(k)!r}" for k in diff)
        asked = ", ".join(f"{k}={new.get(k)!r}" for k in diff)
        if saved_model is not None:
            holds, flags = f"model {saved_model!r}", "the checkpoint's --override values"
        else:
            holds, flags = f"a model of family {meta.get('family')!r}", "the --init-from and --override it started with"
        raise CheckpointError(f"{where} holds {holds} with {had}, this run asks for {asked}: "
                              f"use another --out or {flags}")
    if meta.get("optimizer") not in (None, optimizer):
        raise CheckpointError(
            f"{where} was trained with --optimizer {meta['optimizer']}, not {optimizer}: its state cannot be resumed"
        )


def tokenizer_spec(meta: dict, run_dir: str) -> str | None:
    """The tokenizer a run was trained with: its saved ``RUN/tokenizer`` when it has one, else
    the spec it recorded (None when it recorded none)."""
    saved = os.path.join(run_dir, "tokenizer")
    return saved if meta.get("tokenizer_saved") and os.path.isdir(saved) else meta.get("tokenizer")


def lora_base(meta: dict) -> str | None:
    """The base model a LoRA run's adapters belong to: its ``--init-from`` dir, else its preset."""
    return (meta.get("lora") or {}).get("base") or meta.get("model")
