"""Opening what a user names as a model: one function decides what a path is.

``open_source(path, what=FLAG)`` recognises

- a Hugging Face model directory (``config.json`` with a ``model_type``, and safetensors),
- a shardzoo run (``OUT`` with ``checkpoints/``, or that ``checkpoints/`` dir itself),
- one checkpoint step (``OUT/checkpoints/<step>``),
- a PEFT adapter directory (``adapter_config.json`` and ``adapter_model.safetensors``),

or a Hugging Face Hub model id where an HF directory is accepted (``train/io/hub.py``), and returns
a ``Source``: its ``config``, ``meta`` (family, zoo preset, LoRA base), ``tokenizer``
spec, and ``load_params(target)``, the params placed like ``target``. A run's params come from
its newest restorable step (the readers' rule: newer damaged steps are passed over, in place,
with one warning line each). A bad path is one ``SourceError`` line naming the flag, the path
and what it is. Every command that reads a model (``--init-from``, ``--lora-from``,
``--checkpoint``, ``--hf``, ``export-hf``, ``export-lora``) opens it here.
"""

from __future__ import annotations

import functools
import json
import os

import jax

from shardzoo.models.layout import relayout, relayout_abstract
from shardzoo.train import model_info
from shardzoo.train.io.checkpoint import (
    CHECKPOINTS,
    CheckpointError,
    DamagedCheckpoint,
    all_steps,
    newest_restorable,
    no_restorable,
    read_meta,
    restore_params,
)
from shardzoo.train.io.hub import resolve_model_dir
from shardzoo.train.io.peft import ADAPTER_CONFIG, load_adapters
from shardzoo.train.io.rundir import RunDirError, read_run_json
from shardzoo.train.io.runmeta import config_from_meta, hf_module, lora_base, tokenizer_spec
from shardzoo.train.jit import compile_on

KINDS = ("hf", "run", "step", "adapter")
WORDS = {"hf": "a Hugging Face model directory", "run": "a shardzoo run",
         "step": "a checkpoint step", "adapter": "a PEFT adapter directory"}
NEEDS = {"hf": "no config.json with a model_type and *.safetensors", "run": "no checkpoints/",
         "step": "not OUT/checkpoints/<step>", "adapter": f"no {ADAPTER_CONFIG}"}
READS_RUNS = ("run", "step")  # what --checkpoint, export-hf and export-lora read
READS_MODELS = ("hf", "run", "step")  # what --init-from reads


class SourceError(CheckpointError):
    """A path given as a model source that is missing, of another kind, or unreadable."""


def _words(kinds, needs: bool = False) -> str:
    names = [WORDS[k] + (f" ({NEEDS[k]})" if needs else "") for k in kinds]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def is_step_dir(path: str) -> bool:
    """Whether ``path`` is one checkpoint step (``checkpoints/<step>``), damaged or not: a number
    holding orbax's files, or a number in a shardzoo run's checkpoints dir."""
    if not (os.path.basename(path).isdigit() and os.path.isdir(path)):
        return False
    parent = os.path.dirname(path)
    return (os.path.isdir(os.path.join(path, "state"))
            or os.path.isfile(os.path.join(path, "_CHECKPOINT_METADATA"))
            or (os.path.basename(parent) == CHECKPOINTS
                and os.path.isfile(os.path.join(os.path.dirname(parent), "run.json"))))


def is_checkpoints_dir(path: str) -> bool:
    """Whether ``path`` is a shardzoo run's checkpoints dir (it holds steps, or its run has run.json)."""
    return (os.path.basename(path) == CHECKPOINTS and os.path.isdir(path)
            and (_holds_steps(path) or os.path.isfile(os.path.join(os.path.dirname(path), "run.json"))))


def _holds_steps(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n.isdigit() and is_step_dir(os.path.join(path, n)) for n in names)


def classify(path: str) -> str | None:
    """What the existing directory ``path`` is: one of ``KINDS``, or None (none of them)."""
    if not os.path.isdir(path):
        return None
    if is_step_dir(path):
        return "step"
    if os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        return "adapter"
    hf = hf_module()
    if hf is not None and hf.is_hf_dir(path):
        return "hf"
    if (os.path.isdir(os.path.join(path, CHECKPOINTS)) or os.path.isfile(os.path.join(path, "run.json"))
            or _holds_steps(path)):
        return "run"
    return None


def open_source(path: str, *, step: int | None = None, what: str = "--init-from",
                accept=READS_MODELS) -> Source:
    """The model source ``path`` names (see the module docstring); ``step`` picks one step of a
    run; ``what`` names the flag in messages; ``accept`` the kinds this flag takes."""
    if "hf" in accept:  # a Hugging Face Hub model id: its snapshot in the cache (train/io/hub.py)
        path = resolve_model_dir(str(path), what)
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.exists(path):
        raise SourceError(f"{what} {path}: no such directory")
    if not os.path.isdir(path):
        raise SourceError(f"{what} {path} is a file, not a directory ({_words(accept)})")
    kind = classify(path)
    if kind is None:
        raise SourceError(f"{what} {path} is a directory but not {_words(accept, needs=True)}")
    if kind not in accept:
        hint = "; give its base model to --init-from and the adapter to --lora-from" \
            if kind == "adapter" and what == "--init-from" else ""
        raise SourceError(f"{what} {path} is {WORDS[kind]}, not {_words(accept)}{hint}")
    if step is not None and kind not in READS_RUNS:
        raise SourceError(f"--step {step} picks a checkpoint of a run; {what} {path} is {WORDS[kind]}")
    if kind == "hf":
        return HFSource(path, what)
    if kind == "adapter":
        return AdapterSource(path, what)
    return RunSource(path, what, kind, step)


class Source:
    """A model source: ``kind`` (one of ``KINDS``), ``path`` (absolute) and ``what`` (the flag)."""

    kind = ""

    def __init__(self, path: str, what: str):
        self.path, self.what = path, what

    @property
    def meta(self) -> dict:
        """What the source records of its model: ``model`` (zoo preset), ``family``, ..."""
        return {"model": self.model, "family": self.family}

    model = family = lora_base = tokenizer = None  # zoo preset, HF family, LoRA base, tokenizer spec

    def load_params(self, target, config=None):
        """The params placed like ``target`` (ShapeDtypeStructs with shardings)."""
        raise NotImplementedError


class HFSource(Source):
    """A Hugging Face model directory: its family's mapping of config.json and its safetensors."""

    kind = "hf"

    @functools.cached_property
    def _hf(self):
        return hf_module()

    @functools.cached_property
    def config(self):
        return self.model_config()

    def model_config(self, dtype: str | None = None, scan_layers: bool = True, overrides=None):
        """config.json as this shardzoo's config, with ``dtype``, scanning and ``overrides``."""
        return self._hf.load_hf_config(self.path, dtype, scan_layers, overrides)

    @property
    def meta(self) -> dict:
        """The family, and config.json whole: an export writes back what it says beyond the
        architecture (``pad_token_id``, dropouts, ...)."""
        return {"model": None, "family": self.family, "hf_config": self._hf.read_hf_config(self.path)}

    @functools.cached_property
    def family(self) -> str:
        model_type = self._hf.read_hf_config(self.path).get("model_type")
        return self._hf.family_of_model_type(model_type, os.path.join(self.path, "config.json")).name

    @property
    def tokenizer(self) -> str:
        return self.path  # its tokenizer.json (data.load_tokenizer says when there is none)

    def load_params(self, target, config=None):
        return self._hf.load_hf_params(self.path, target, config if config is not None else self.config)


class RunSource(Source):
    """A shardzoo run or one of its steps: ``root`` (its checkpoints dir), ``steps`` (newest
    first; one for a step dir or ``--step``), ``run_dir``; ``step`` is the step whose meta (and,
    after ``load_params``, params) were read."""

    def __init__(self, path: str, what: str, kind: str, step: int | None):
        super().__init__(path, what)
        self.kind = kind
        if kind == "step":
            if step is not None and step != int(os.path.basename(path)):
                raise SourceError(f"{what} {path} is the checkpoint of step {os.path.basename(path)}, "
                                  f"not --step {step}")
            self.root, self.steps = os.path.dirname(path), [int(os.path.basename(path))]
        else:
            nested = os.path.join(path, CHECKPOINTS)
            self.root = nested if os.path.isdir(nested) or not _holds_steps(path) else path
            self.steps = all_steps(self.root)
            if not self.steps:
                where = f"{self.root} holds no step" if os.path.isdir(self.root) else f"it has no {CHECKPOINTS}/"
                raise SourceError(f"{what} {path} is a shardzoo run without a finished checkpoint ({where})")
            if step is not None:
                if step not in self.steps:
                    raise SourceError(f"{what} {path} has no checkpoint of --step {step} (it has steps "
                                      f"{', '.join(map(str, sorted(self.steps)))})")
                self.steps = [step]
        self.run_dir = os.path.dirname(self.root)
        self.step = None

    @functools.cached_property
    def _meta(self) -> dict:
        """The meta of the newest step whose meta reads (newer damaged ones are named by
        ``load_params``, which passes over them too)."""
        damaged = []
        for step in self.steps:
            try:
                meta = read_meta(self.root, step)
            except DamagedCheckpoint as e:
                damaged.append(e)
                continue
            self.step = step
            return meta
        raise SourceError(f"{self.what} {no_restorable(self.root, damaged)}")

    @property
    def meta(self) -> dict:
        """The whole meta its step recorded (model, family, config, rules, tokenizer, lora, ...)."""
        return self._meta

    @functools.cached_property
    def config(self):
        meta = self._meta
        return config_from_meta(meta, f"{self.what} {os.path.join(self.root, str(self.step))}")

    @property
    def model(self):
        return self._meta.get("model")

    @property
    def family(self):
        return self._meta.get("family")

    @property
    def lora_base(self):
        return lora_base(self._meta)

    @property
    def tokenizer(self) -> str | None:
        return tokenizer_spec(self._meta, self.run_dir)

    def load_params(self, target, config=None):
        """The params of the newest restorable step (or the one named), placed like ``target``;
        for a ``config`` that scans its layers otherwise than the run did (``scan_layers``,
        ``scan_layout``), moved into its layout (``models.layout.relayout``)."""
        def load(step):
            meta = read_meta(self.root, step)
            moved = _layouts(config_from_meta(meta, self.what), config)
            if moved is None:
                return meta, restore_params(self.root, step, target)
            params = restore_params(self.root, step, relayout_abstract(target, *moved[::-1]))
            shardings = jax.tree.map(lambda t: t.sharding, target)
            mesh = jax.tree.leaves(shardings)[0].mesh
            return meta, compile_on(mesh, lambda p: relayout(p, *moved), params, out_shardings=shardings)(params)

        try:
            step, (meta, params) = newest_restorable(self.root, self.steps, load)
        except CheckpointError as e:
            raise SourceError(f"{self.what} {e}") from None
        self.step, self.__dict__["_meta"] = step, meta
        return params

    def run_settings(self) -> dict:
        """The data settings (``data``, columns, ``eval_fraction``, ``add_bos``, ``seq_len``) and
        ``seed`` the run recorded in its run.json; empty when it has none (e.g. an import-hf dir).
        A run.json that does not parse is a SourceError naming it."""
        try:
            run = read_run_json(self.run_dir)
        except RunDirError as e:
            raise SourceError(f"{self.what} {self.path}: {e}; eval takes the run's data settings "
                              f"from it: restore it") from None
        settings = run.get("settings") if isinstance(run, dict) else None
        if not isinstance(settings, dict):
            return {}
        recorded = {k: v for k, v in (settings.get("data") or {}).items() if v is not None}
        seed = (settings.get("optimizer") or {}).get("seed")
        return {**recorded, "seed": seed} if seed is not None else recorded


class AdapterSource(Source):
    """A PEFT LoRA adapter directory: ``config`` is its checked adapter_config.json."""

    kind = "adapter"

    @functools.cached_property
    def config(self) -> dict:
        where = os.path.join(self.path, ADAPTER_CONFIG)
        try:
            with open(where) as f:
                conf = json.load(f)
        except OSError as e:
            raise SourceError(f"{self.what} {self.path}: cannot read {ADAPTER_CONFIG}: {e.strerror}") from None
        except ValueError as e:
            raise SourceError(f"{where}: not JSON: {e}") from None
        if not isinstance(conf, dict) or conf.get("peft_type") != "LORA":
            kind = conf.get("peft_type") if isinstance(conf, dict) else None
            raise SourceError(f"{where}: peft_type {kind!r}, shardzoo reads LORA adapters")
        unsupported = [k for k in ("use_rslora", "use_dora", "fan_in_fan_out", "rank_pattern",
                                   "alpha_pattern", "layers_to_transform", "modules_to_save")
                       if conf.get(k)]
        if conf.get("bias", "none") != "none":
            unsupported.append(f"bias={conf['bias']!r}")
        if unsupported:
            raise SourceError(f"{where}: {', '.join(unsupported)} not supported (plain LoRA only)")
        return conf

    @property
    def lora_base(self):
        return self.config.get("base_model_name_or_path")

    def load_params(self, target, config=None, family=None):
        """The adapters placed like ``target`` (the adapter leaves), for the model ``config``."""
        return load_adapters(self.path, target, config, family)


def _layouts(stored, config):
    """``(the run's layer layout, config's)`` where they differ, else None."""
    if config is None or not hasattr(stored, "layout") or not hasattr(config, "layout"):
        return None
    source, target = stored.layout(), config.layout()
    return None if source.param_layout() == target.param_layout() else (source, target)


# ------------------------------------------------------------------------------ loading
def load_model(source: Source, mesh, rules, dtype: str | None = None):
    """``(module, config, params)`` of an HF or run source, the params placed as the one
    ``Program`` of that model lays them out under ``rules`` on ``mesh``; ``dtype`` (e.g.
    bfloat16) for params and compute, default the source's own."""
    from shardzoo.train.program import Program

    if source.kind == "hf":
        config = source.model_config(dtype)
        program = Program(config, rules, mesh)
        return program.module, config, source.load_params(program.params_target(), config)
    config = source.config
    program = Program(config, rules, mesh)
    module, params = program.module, source.load_params(program.params_target())
    if dtype is not None and dtype != model_info.param_dtype(config):
        config = model_info.with_dtype(config, dtype)
        module, params = Program(config, rules, mesh).module, jax.tree.map(lambda x: x.astype(dtype), params)
    return module, config, params


def load_model_and_params(path: str, mesh=None, rules=None, step: int | None = None,
                          what: str = "--checkpoint"):
    """``(module, config, params, tokenizer_spec)`` of a run's newest restorable checkpoint (a
    newer damaged one is passed over with a warning line and left in place), or of ``step``.

    Without ``mesh``/``rules`` the params land whole on the first device. ``tokenizer_spec`` is
    ``OUT/tokenizer`` when the run saved its tokenizer, else the spec it was trained with.
    """
    from shardzoo.sharding.mesh import make_mesh
    from shardzoo.sharding.rules import get_rules

    source = open_source(path, step=step, what=what, accept=READS_RUNS)
    mesh = mesh if mesh is not None else make_mesh("", devices=jax.devices()[:1])
    module, config, params = load_model(source, mesh, get_rules(rules if rules is not None else "dp"))
    return module, config, params, source.tokenizer


def init_params_from(path: str, target, config=None, mesh=None, rules=None):
    """Params for ``--init-from PATH`` (an HF dir, a run or a step), placed as ``target``."""
    return open_source(path).load_params(target, config)


def resolve_checkpoint(path: str) -> tuple[str, int]:
    """``(checkpoints_root, newest step)`` of a run dir, its checkpoints dir or one step dir."""
    source = open_source(path, what="checkpoint", accept=READS_RUNS)
    return source.root, source.steps[0]
