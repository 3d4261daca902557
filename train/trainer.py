"""The Trainer wires a model, a rule table, a mesh and data iterators to the pure steps.

It is generic: any flax module following the zoo's model-call contract, with a config that
has ``sample_inputs``. It resumes from ``OUT/checkpoints`` when there is one, saves every
``save_every`` steps and at the end, saves and returns on SIGTERM (preemption), and stops with
``NonFiniteError`` at the first NaN/Inf loss or gradient (or skips such steps when asked).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import signal
import threading
import time

import jax
import numpy as np

from shardzoo import interrupt
from shardzoo.sharding.mesh import describe_mesh
from shardzoo.sharding.partition import replicated
from shardzoo.train.io.checkpoint import Checkpointer, read_meta, restore_params
from shardzoo.train.io.runmeta import check_same_model, config_to_dict
from shardzoo.train.jit import per_device_bytes
from shardzoo.train.metrics import MetricsLogger, progress
from shardzoo.train.program import settings_program
from shardzoo.train.step import merge_sums
from shardzoo.train.tasks.base import summarize_eval


class NonFiniteError(RuntimeError):
    """A NaN or Inf loss or gradient norm at ``step``; nothing after the last good checkpoint is saved."""

    def __init__(self, step: int, loss: float, grad_norm: float, last_checkpoint: int | None):
        self.step, self.last_checkpoint = step, last_checkpoint
        saved = f"the last good checkpoint is step {last_checkpoint}" if last_checkpoint is not None \
            else "no checkpoint was written"
        super().__init__(
            f"non-finite loss or gradient at step {step} (loss {loss}, grad_norm {grad_norm}); "
            f"{saved}; --skip-nonfinite skips such steps instead"
        )


def is_main_process() -> bool:
    return jax.process_index() == 0


def say(*args) -> None:
    """Print from process 0 only."""
    if is_main_process():
        print(*args, flush=True)


class Hook:
    """Behaviour injected into the training loop (Levanter's hooks): override what you need.

    ``before_step`` may return a replacement batch; ``after_step`` may add entries to the
    step's logged record. Tests inject faults (a NaN weight), batch hashes and delays this way;
    the jitted step never sees them.
    """

    def before_step(self, trainer, step: int, batch):
        return batch

    def after_step(self, trainer, step: int, batch, record: dict) -> None:
        pass


def batch_hash(batch) -> str:
    """A short hash of a batch's arrays, gathered across processes (proves the order of resumes)."""
    from jax.experimental import multihost_utils

    h = hashlib.sha1()
    for key in sorted(batch):
        x = batch[key]
        if isinstance(x, jax.Array) and jax.process_count() > 1:
            x = multihost_utils.process_allgather(x, tiled=True)
        h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
    return h.hexdigest()[:16]


class Trainer:
    """Trains ``module`` under ``rules`` on ``mesh`` from ``train_data``; see ``fit``.

    ``cfg`` is a TrainConfig (steps, optimizer, batch, out, ...). ``meta`` (model name,
    overrides, tokenizer, rules and mesh specs) is stored in every checkpoint; ``init_params``
    (target -> params) replaces the random init of a fresh run (``--init-from``). ``hooks``:
    ``Hook`` objects called around every step. The step itself is ``program``'s (default: the
    ``settings_program`` of these settings, which trains the model's own task; a ``--task`` run
    passes ``tasks.registry.run_program``'s). ``log``: where progress lines go (default: stdout, from
    process 0).
    """

    def __init__(self, module, model_config, cfg, mesh, rules, train_data, eval_data=None, *,
                 opt_rules=None, meta=None, init_params=None, hooks=(), program=None, log=None,
                 reference_params=None):
        self.module, self.model_config, self.cfg = module, model_config, cfg
        self.mesh, self.rules, self.opt_rules = mesh, rules, opt_rules
        self.train_data, self.eval_data = train_data, eval_data
        self.meta = dict(meta or {})
        self.meta.setdefault("config", config_to_dict(model_config))
        self.meta.update(optimizer=cfg.optimizer, mesh=describe_mesh(mesh),
                         rules=self.meta.get("rules") or getattr(rules, "name", ""))
        self.init_params = init_params
        self._reference_source = reference_params  # target -> the reference's params (dpo)
        self.reference_params = None
        self.hooks = tuple(hooks)
        self.program = program
        self.log = log or say
        self.history: list[dict] = []
        self.nonfinite_skipped = 0
        self._stop = threading.Event()
        self.stop_signal = None  # SIGTERM or SIGINT, once one has asked the run to stop
        self._setup()

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        cfg = self.cfg
        if self.program is None:
            self.program = settings_program(cfg, self.model_config, self.rules, self.mesh,
                                            opt_rules=self.opt_rules)
        self.shardings, self.tx, self.schedule = self.program.shardings, self.program.tx, self.program.schedule
        self.checkpointer = Checkpointer(cfg.out, cfg.keep)
        target = self.program.abstract
        # the newest step that restores; newer damaged ones are moved aside with one line each
        latest = self.checkpointer.restore_newest(functools.partial(self._start, target))
        self.last_saved = latest  # the newest checkpoint on disk
        self._setup_reference()
        self._eval_start = self.eval_data.state() if self.eval_data is not None else None
        self._train_step = self.program.compiled_train_step()
        self.compile_seconds = self.program.compile_seconds  # compiled here or when its fit was checked

    def _start(self, target, latest: int | None) -> None:
        root = self.checkpointer.root
        meta = read_meta(root, latest) if latest is not None else None
        if meta is not None:
            check_same_model(meta, self.meta.get("model"), self.meta["config"], self.cfg.optimizer,
                             os.path.join(root, str(latest)))
        if meta is not None and "optimizer" in meta:
            self._resume(latest, target)
        else:
            if meta is not None:  # a params-only checkpoint (import-hf): start from its params
                self.init_params = functools.partial(restore_params, root, latest)
            self._init(target)

    def _resume(self, step: int, target) -> None:
        self.state, data = self.checkpointer.restore(step, target)
        self.train_data.restore(data["train"])
        self.rng = jax.device_put(np.asarray(data["rng"], np.uint32), replicated(self.mesh))
        self.nonfinite_skipped = int(data.get("nonfinite_skipped", 0))
        self.start_step = step
        self.log(f"resumed from {os.path.join(self.checkpointer.root, str(step))}")

    def _keys(self):
        """(the run's step key, the init key), both from the seed."""
        return np.asarray(jax.random.split(jax.random.PRNGKey(self.cfg.seed)), np.uint32)

    # ------------------------------------------------------------------ the reference model (dpo)
    def _load_reference(self):
        """The reference's params: ``--reference``, ``--init-from`` or, with neither, the
        seed's initial params (the policy at step 0, recomputed on a resume)."""
        target = self.program.abstract.params
        given = self._reference_source(target) if self._reference_source is not None else None
        return self.program.init(self._keys()[1], params=given).params  # LoRA: adapters filled in

    def _setup_reference(self) -> None:
        """A frozen copy (``Program.reference == "copy"``), or the reference log-probs of every
        pair computed once and stored with the run (``"stored"``: ``OUT/reference_logps.npy``,
        read back on a resume)."""
        kind = self.program.reference
        if kind == "teacher":  # distillation: the teacher's own params (its family, its layout)
            self.reference_params = self._reference_source(self.program.teacher.target)
        elif kind == "copy":
            self.reference_params = self._load_reference()
        elif kind == "stored":
            params = None
            for split, name in (("train_data", "reference_logps.npy"), ("eval_data", "reference_logps_eval.npy")):
                data = getattr(self, split)
                if data is None:
                    continue
                path = os.path.join(self.cfg.out, name)
                logps = np.load(path) if os.path.exists(path) else None
                if logps is None or logps.shape != (len(data.rows), 2):
                    params = self._load_reference() if params is None else params
                    logps = self._reference_pass(data, params)
                    if is_main_process():
                        tmp = path + ".tmp.npy"
                        np.save(tmp, logps)
                        os.replace(tmp, path)
                    self.log(f"stored the reference log-probs of {len(logps)} pairs in {path}")
                setattr(self, split, data.with_rows(data.rows.with_reference(logps)))

    def _reference_pass(self, data, params) -> np.ndarray:
        """``[pairs, 2]``: the reference's summed completion log-probs of every pair of ``data``."""
        from jax.experimental import multihost_utils

        step, outs = self.program.compiled_reference_step(), []
        for batch in data.with_rows(data.rows, in_order=True):
            out = step(params, self.program.place(batch))["ref_logps"]
            outs.append(np.asarray(multihost_utils.process_allgather(out, tiled=True)
                                   if jax.process_count() > 1 else out))
        return np.concatenate(outs)[: len(data.rows)].astype(np.float32)

    def complete(self, placed: dict, params) -> dict:
        """A placed batch with its reference entries (a preference task's reference step on the
        frozen copy, or on ``params`` with the adapters off); other batches as they are."""
        keys = self.program.task.reference_keys
        if not keys or all(k in placed for k in keys):
            return placed
        ref = self.reference_params if self.reference_params is not None else params
        return {**placed, **self.program.compiled_reference_step()(ref, placed)}

    def _init(self, target) -> None:
        key, init_key = self._keys()
        params = self.init_params(target.params) if self.init_params else None
        self.state = self.program.init(init_key, params=params)
        self.rng = jax.device_put(key, replicated(self.mesh))
        self.start_step = 0

    def describe(self) -> str:
        """What one device holds of the params and of the optimizer state."""
        s, sh = self.state, self.shardings
        total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(s.params))
        return (
            f"mesh {describe_mesh(self.mesh)}: params {_mib(total)} in all, "
            f"{_mib(per_device_bytes(s.params, sh.params))} per device; optimizer state "
            f"{_mib(per_device_bytes(s.opt_state, sh.opt_state))} per device"
            + (f" (rules {self.opt_rules.name})" if self.opt_rules is not None else "")
            + _REFERENCE_WORDS.get(self.program.reference, "")
        )

    # ------------------------------------------------------------------ steps
    def train_step(self, state, batch) -> tuple:
        """One compiled step: ``(new_state, metrics)``; ``state`` is donated."""
        return self._train_step(state, self.complete(self.program.place(batch), state.params), self.rng)

    def evaluate(self, sample: bool = False) -> dict:
        """The task's eval metrics over the whole held-out split (one pass of an iterator that
        knows its length, as ``shardzoo eval --split eval`` scores it), or, with ``sample`` (the
        periodic evaluations), over its first ``eval_steps`` batches, named ``eval_*_sampled``
        when that is less than the split. An iterator of unknown length is read for
        ``eval_steps`` batches."""
        if self.eval_data is None:
            return {}
        length = getattr(self.eval_data, "batches_per_epoch", None)
        limit = self.cfg.eval_steps if (sample or length is None) else length
        sampled = sample and length is not None and limit < length
        self.eval_data.restore(self._eval_start)
        step = self.program.compiled_eval_step()
        totals = None
        with progress(min(limit, length) if length is not None else limit, "eval", is_main_process()) as bar:
            for i, batch in enumerate(self.eval_data):
                if i >= limit:
                    break
                # each batch's sums to the host, added in float64 (as shardzoo eval adds them): no
                # queue of hundreds of dispatches on a long split, and the same rounding
                placed = self.complete(self.program.place(batch), self.state.params)
                out = jax.device_get(step(self.state.params, placed))
                out = {k: np.float64(v) for k, v in out.items()}
                totals = out if totals is None else merge_sums(totals, out)
                bar.update()
        if totals is None:
            return {}
        summary = summarize_eval(self.program.task, totals)
        return {f"{k}_sampled": v for k, v in summary.items()} if sampled else summary

    def _check_finite(self, step: int, metrics) -> None:
        if bool(metrics["finite"]):
            return
        if self.cfg.skip_nonfinite:
            self.nonfinite_skipped += 1
            return
        host = jax.device_get(metrics)
        self.history.append({"step": step, **_scalars(host)})
        self.logger.log(step, _scalars(host))
        raise NonFiniteError(step, float(host["loss"]), float(host["grad_norm"]), self.last_saved)

    def save(self, step: int) -> None:
        data = {"train": self.train_data.state(), "rng": np.asarray(self.rng).tolist(),
                "seed": self.cfg.seed, "nonfinite_skipped": self.nonfinite_skipped}
        self.checkpointer.save(step, self.state, data, self.meta)
        self.last_saved = step

    def _stop_requested(self) -> bool:
        stop = self._stop.is_set()
        if jax.process_count() > 1:  # every process stops at the same step, or saves would hang
            from jax.experimental import multihost_utils

            stop = bool(np.any(multihost_utils.process_allgather(np.asarray(stop))))
        return stop

    # ------------------------------------------------------------------ loop
    def fit(self, stop_after: int | None = None) -> list[dict]:
        """Train up to ``cfg.steps`` (or ``stop_after``) steps; return the logged records.

        On SIGTERM: save at the current step and return. On a non-finite step (without
        ``skip_nonfinite``): raise NonFiniteError, leaving the last good checkpoint.
        """
        cfg = self.cfg
        end = min(cfg.steps, stop_after or cfg.steps)
        # a first Ctrl-C from here to the last save's end asks for a save and a stop, never cuts one
        with interrupt.stoppable(lambda signum: self._on_signal(signum, None)):
            self.logger = MetricsLogger(cfg.out, cfg.steps, self.start_step, cfg.tensorboard, is_main_process(),
                                        getattr(cfg, "wandb", None),
                                        cfg.to_sections() if hasattr(cfg, "to_sections") else None,
                                        signals=self.program.task.signals)
            previous = {}
            if threading.current_thread() is threading.main_thread():
                previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
            try:
                self._loop(end)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                self.checkpointer.close()
                self.logger.close()
        return self.history

    def _on_signal(self, signum, frame) -> None:
        """SIGTERM or a first Ctrl-C: save at the current step and stop; a second Ctrl-C aborts
        (``shardzoo.interrupt`` calls this from its own thread under ``python -m shardzoo``)."""
        self.stop_signal = signum
        self._stop.set()
        if signum == signal.SIGINT and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _loop(self, end: int) -> None:
        cfg, step = self.cfg, self.start_step
        tokens_per_step = cfg.batch_size * (cfg.seq_len if self.program.task.weight_name == "tokens" else 1)
        timer = _StepTimer()
        pending = None  # (step, metrics) of a step whose finiteness is not checked yet
        while step < end and not self._stop_requested():
            try:
                batch = next(self.train_data)
            except StopIteration:
                self.log(f"the training data ran out after step {step}")
                break
            for hook in self.hooks:
                batch = hook.before_step(self, step + 1, batch)
            self.state, metrics = self.train_step(self.state, batch)
            self.checkpointer.check()  # a failed async save ends the run now, not at the next save
            record = {}
            step += 1
            timer.steps += 1
            if pending is not None:  # the previous step's flag: ready without waiting for this step
                self._check_finite(*pending)
            pending = (step, metrics)
            self.logger.advance()
            for hook in self.hooks:
                hook.after_step(self, step, batch, record)
            if step % cfg.log_every == 0 or step in (1, end):  # step 1: the loss at the start
                self._check_finite(*pending)
                pending = None
                record.update(_scalars(jax.device_get(metrics)),
                              **timer.lap(tokens_per_step, self.program.task.weight_name))
                if cfg.skip_nonfinite:
                    record["nonfinite_skipped"] = self.nonfinite_skipped
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                with timer.paused():  # the final evaluation scores the whole held-out split
                    record.update(self.evaluate(sample=step != cfg.steps))
            if record:
                self.history.append({"step": step, **record})
                self.logger.log(step, record)
            if (cfg.save_every and step % cfg.save_every == 0) or step == end:
                if pending is not None:  # never save a state that is not known to be finite
                    self._check_finite(*pending)
                    pending = None
                with timer.paused():
                    self.save(step)
        if pending is not None:
            self._check_finite(*pending)
        if self._stop.is_set():
            self.log(f"{signal.Signals(self.stop_signal).name}: saving a checkpoint at step {step} and stopping")
        if self.last_saved != step:
            self.save(step)
        self.final_step = step


class _StepTimer:
    """Wall time per train step between two logs, leaving out evaluation and checkpointing."""

    def __init__(self):
        self.start, self.steps, self.excluded = time.perf_counter(), 0, 0.0

    @contextlib.contextmanager
    def paused(self):
        t0 = time.perf_counter()
        yield
        self.excluded += time.perf_counter() - t0

    def lap(self, units_per_step: int, unit: str = "tokens") -> dict:
        now = time.perf_counter()
        step_time = (now - self.start - self.excluded) / max(self.steps, 1)
        self.start, self.steps, self.excluded = now, 0, 0.0
        return {"step_time_s": step_time, f"{unit}_per_sec": units_per_step / step_time}


_REFERENCE_WORDS = {  # how a preference task's reference model is held (Program.reference)
    "copy": "; reference model: a frozen copy, sharded as the params",
    "adapters": "; reference model: the base with the LoRA adapters off (no copy)",
    "stored": "; reference model: log-probs stored with the run (no model)",
    "teacher": "; teacher: a frozen model of its own, sharded by the same rules",
}


def _scalars(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items() if k != "finite"}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"

