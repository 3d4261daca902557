"""Checkpoints with orbax: layout, resharding restore, and loading a run's model for export.

Layout of a run directory ``OUT``::

    OUT/run.json                 resolved settings of the latest start (model, overrides, ...)
    OUT/tokenizer/               the tokenizer's files, when it has any
    OUT/checkpoints/<step>/      orbax Composite: state (TrainState arrays, StandardSave),
                                 data (iterator position + RNG, JSON), meta (model preset,
                                 family, whole config, rules, mesh, tokenizer, optimizer; JSON)

Half-written steps live in ``<step>.orbax-checkpoint-tmp-*`` and are never picked up.
Restores build ``jax.ShapeDtypeStruct`` targets carrying the *new* shardings, so a checkpoint
written under one mesh and rule table loads onto any other.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax
import orbax.checkpoint as ocp

from shardzoo.errors import UserError
from shardzoo.models import apply_overrides, get_config
from shardzoo.sharding.mesh import make_mesh
from shardzoo.sharding.rules import get_rules
from shardzoo.train.program import Program

CHECKPOINTS = "checkpoints"
FORMAT = 1



class CheckpointError(UserError):
    """A checkpoint or run directory the user named is missing, unreadable or does not match."""


def jsonable(value):
    """A JSON-safe copy (tuples become lists, unknown objects their str)."""
    return json.loads(json.dumps(value, default=str))


def config_to_dict(config) -> dict:
    return jsonable(dataclasses.asdict(config))


def model_meta(config, model: str | None = None, family: str | None = None) -> dict:
    """What a checkpoint records of its model: ``model``, the zoo preset the run started from
    (None when it started from an HF dir or a run that had none), ``family``, the Hugging Face
    family whose config class rebuilds it (default: the first that expresses ``config``; None
    if none does), and the whole ``config``."""
    hf = hf_module()
    if family is None and hf is not None:
        try:
            family = hf.family_of_config(config).name
        except hf.HFError:
            family = None
    return {"model": model, "family": family, "config": config_to_dict(config)}


def _tuples(value):
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def config_from_meta(meta: dict, where: str = "the checkpoint"):
    """The model config a checkpoint was written with: its family's config class built from the
    whole stored config; for a checkpoint without a family (older, or a model no HF family
    expresses), its preset ``model`` with the stored fields applied."""
    stored = {k: _tuples(v) for k, v in (meta.get("config") or {}).items()}
    name = meta.get("family")
    if name is not None:
        hf = hf_module()
        family = hf.family_named(name) if hf is not None else None
        if family is None:
            raise CheckpointError(f"{where} records model family {name!r}, which this shardzoo "
                                  f"does not know")
        known = {f.name for f in dataclasses.fields(family.config_class)}
        unknown = sorted(set(stored) - known)
        if unknown:
            raise CheckpointError(f"{where}: its {name} config has unknown field(s) "
                                  f"{', '.join(unknown)}")
        return family.config_class(**stored)
    if meta.get("model") is None:
        raise CheckpointError(f"{where} records neither a model family nor a zoo preset")
    return apply_overrides(get_config(meta["model"]), stored,
                           where=f"{where}: model {meta['model']!r}")


def check_same_model(meta: dict, model: str | None, config: dict, optimizer: str, where: str) -> None:
    """A resumed run must ask for the model config and optimizer its checkpoint holds."""
    saved_model = meta.get("model")
    if model is not None and saved_model is not None and saved_model != model:
        raise CheckpointError(
            f"{where} holds model {saved_model!r}, not {model!r}: use another --out or --model {saved_model}"
        )
    saved, new = meta.get("config") or {}, jsonable(config)
    diff = [k for k in sorted(set(saved) | set(new)) if saved.get(k) != new.get(k)]
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


def _manager(root: str, read_only: bool, keep: int | None = None) -> ocp.CheckpointManager:
    if not read_only:
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True)
        return ocp.CheckpointManager(root, options=options)
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # orbax warns that a read-only manager will not save: not news
    try:
        return ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True, create=False))
    finally:
        absl.setLevel(level)


def resolve_checkpoint(path: str) -> tuple[str, int]:
    """``(checkpoints_root, step)`` for a run dir, its checkpoints dir or one ``<step>`` dir."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory")
    base = os.path.basename(path.rstrip("/"))
    if base.isdigit() and os.path.isdir(os.path.join(path, "state")):
        return os.path.dirname(path), int(base)
    root = os.path.join(path, CHECKPOINTS) if os.path.isdir(os.path.join(path, CHECKPOINTS)) else path
    step = latest_step(root)
    if step is None:
        raise CheckpointError(f"{path}: no finished checkpoint (expected a shardzoo run or checkpoint dir)")
    return root, step


def latest_step(root: str) -> int | None:
    """The newest finished checkpoint step under ``root`` (None if none); creates nothing."""
    if not os.path.isdir(root):
        return None
    return _manager(root, read_only=True).latest_step()


def read_meta(root: str, step: int) -> dict:
    try:
        restored = _manager(root, read_only=True).restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001 - any failure here is an unreadable checkpoint
        raise CheckpointError(f"{root}/{step}: cannot read the checkpoint's meta: {e}".splitlines()[0]) from None
    return restored.meta


class Checkpointer:
    """Writes and restores one run's checkpoints (async; keeps the newest ``keep``)."""

    def __init__(self, out_dir: str, keep: int):
        self.root = os.path.join(out_dir, CHECKPOINTS)
        self.manager = _manager(self.root, read_only=False, keep=keep)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data: dict, meta: dict) -> None:
        """Start an async save of ``state`` (arrays), ``data`` and ``meta`` (JSON) at ``step``."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(jsonable(data)),
            meta=ocp.args.JsonSave(jsonable({**meta, "step": step, "format": FORMAT})),
        )
        self.manager.save(step, args=args, force=True)

    def restore(self, step: int, target) -> tuple:
        """``(state, data)``; ``target`` is a tree of ShapeDtypeStructs with the new shardings."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
        try:
            restored = self.manager.restore(step, args=args)
        except ValueError as e:
            raise CheckpointError(
                f"{self.root}/{step}: the saved train state does not match this run's "
                f"(model or optimizer changed?): {str(e).splitlines()[0]}"
            ) from None
        return restored.state, restored.data

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def restore_params(root: str, step: int, target):
    """Only the params of a checkpoint, onto ``target`` (ShapeDtypeStructs with shardings)."""
    restore_args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding), target)
    args = ocp.args.PyTreeRestore({"params": target}, restore_args={"params": restore_args}, partial_restore=True)
    try:
        restored = _manager(root, read_only=True).restore(step, args=ocp.args.Composite(state=args))
    except (ValueError, KeyError) as e:
        raise CheckpointError(
            f"{root}/{step}: its params do not match the model: {str(e).splitlines()[0]}"
        ) from None
    return restored.state["params"]


def hf_module():
    try:
        from shardzoo.models import hf
    except ImportError:
        return None
    return hf if hasattr(hf, "is_hf_dir") else None


def init_params_from(path: str, target, config, mesh, rules):
    """Params for ``--init-from PATH``, placed as ``target`` (ShapeDtypeStructs with shardings).

    PATH is a shardzoo run or checkpoint dir, or (the hook for Hugging Face model dirs, when
    ``shardzoo.models.hf.is_hf_dir`` says so) an HF model dir read by ``train.hf_io.load_hf``;
    either way the params must have the shapes of the run's model.
    """
    hf = hf_module()
    if hf is not None and os.path.isdir(path) and hf.is_hf_dir(path):
        return hf.load_hf_params(path, target, config)
    try:
        root, step = resolve_checkpoint(path)
    except CheckpointError as e:
        raise CheckpointError(f"--init-from {e}") from None
    return restore_params(root, step, target)


def _check_shapes(params, target, where: str) -> None:
    got = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    want = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
    for key in sorted(set(got) | set(want)):
        if got.get(key) != want.get(key):
            raise CheckpointError(f"{where}: param {key} has shape {got.get(key)}, the model wants {want.get(key)}")


def load_model_and_params(run_dir_or_checkpoint_dir: str, mesh=None, rules=None):
    """``(module, config, params, tokenizer_spec)`` of a run's latest (or the named) checkpoint.

    Without ``mesh``/``rules`` the params land whole on the first device. ``tokenizer_spec`` is
    ``OUT/tokenizer`` when the run saved its tokenizer, else the spec it was trained with.
    """
    root, step = resolve_checkpoint(run_dir_or_checkpoint_dir)
    meta = read_meta(root, step)
    config = config_from_meta(meta, os.path.join(root, str(step)))
    module = config.build()
    mesh = mesh if mesh is not None else make_mesh("", devices=jax.devices()[:1])
    rules = get_rules(rules if rules is not None else "dp")
    params = restore_params(root, step, Program(config, rules, mesh, module=module).params_target())
    run_dir = os.path.dirname(root)
    saved = os.path.join(run_dir, "tokenizer")
    tokenizer_spec = saved if meta.get("tokenizer_saved") and os.path.isdir(saved) else meta.get("tokenizer")
    return module, config, params, tokenizer_spec
