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
import math
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from shardzoo.sharding import axes as ax
from shardzoo.sharding.mesh import describe_mesh
from shardzoo.sharding.partition import activate, replicated, spec_to_sharding
from shardzoo.train.checkpoint import (
    Checkpointer,
    check_same_model,
    config_to_dict,
    read_meta,
    restore_params,
)
from shardzoo.train.config import ConfigError
from shardzoo.train.metrics import MetricsLogger
from shardzoo.train.optim import make_optimizer
from shardzoo.train.state import (
    abstract_params,
    compile_cached,
    init_state,
    per_device_bytes,
    state_shardings,
    with_shardings,
)
from shardzoo.train.step import BATCH_KEYS, eval_step, summarize_eval, train_step

BATCH_DTYPES = {"weights": np.float32}  # every other batch key is int32


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


def batch_hash(batch) -> str:
    """A short hash of a batch's tokens and weights (the debug aid that proves resume order)."""
    from jax.experimental import multihost_utils

    h = hashlib.sha1()
    for key in ("inputs", "targets", "weights"):
        x = batch[key]
        if jax.process_count() > 1:  # the global batch spans other processes' devices
            x = multihost_utils.process_allgather(x, tiled=True)
        h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
    return h.hexdigest()[:16]


def check_microbatch(batch_size: int, grad_accum: int, mesh, rules) -> None:
    """Each microbatch must split evenly over the devices that the rules shard the batch over."""
    spec = spec_to_sharding((ax.BATCH, ax.LENGTH), mesh, rules).spec
    names = spec[0] if len(spec) else None
    names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
    shards = math.prod(mesh.shape[n] for n in names)
    if (batch_size // grad_accum) % shards:
        raise ConfigError(
            f"microbatch of {batch_size // grad_accum} rows (--batch-size {batch_size} / --grad-accum "
            f"{grad_accum}) is not divisible by the {shards} devices that rules "
            f"{getattr(rules, 'name', '')!r} shard the batch over on mesh {describe_mesh(mesh)}"
        )


class Trainer:
    """Trains ``module`` under ``rules`` on ``mesh`` from ``train_data``; see ``fit``.

    ``cfg`` is a TrainConfig (steps, optimizer, batch, out, ...). ``meta`` (model name,
    overrides, tokenizer, rules and mesh specs) is stored in every checkpoint; ``init_params``
    (target -> params) replaces the random init of a fresh run (``--init-from``).
    """

    def __init__(self, module, model_config, cfg, mesh, rules, train_data, eval_data=None, *,
                 opt_rules=None, meta=None, init_params=None):
        self.module, self.model_config, self.cfg = module, model_config, cfg
        self.mesh, self.rules, self.opt_rules = mesh, rules, opt_rules
        self.train_data, self.eval_data = train_data, eval_data
        self.meta = dict(meta or {})
        self.meta.setdefault("config", config_to_dict(model_config))
        self.meta.update(optimizer=cfg.optimizer, mesh=describe_mesh(mesh),
                         rules=self.meta.get("rules") or getattr(rules, "name", ""))
        self.init_params = init_params
        self.history: list[dict] = []
        self.nonfinite_skipped = 0
        self._stop = threading.Event()
        self._setup()

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        cfg, mesh, rules = self.cfg, self.mesh, self.rules
        self.micro_batch = cfg.batch_size // cfg.grad_accum
        sample = self.model_config.sample_inputs(self.micro_batch, cfg.seq_len)
        boxed = abstract_params(self.module, sample, mesh, rules)
        self.tx, self.schedule = make_optimizer(cfg, boxed)
        abstract, self.shardings = state_shardings(boxed, self.tx, mesh, rules, self.opt_rules)
        self.batch_sharding = spec_to_sharding((ax.BATCH, ax.LENGTH), mesh, rules)
        self.batch_shape = (cfg.batch_size, cfg.seq_len)
        check_microbatch(cfg.batch_size, cfg.grad_accum, mesh, rules)
        self.checkpointer = Checkpointer(cfg.out, cfg.keep)
        target = with_shardings(abstract, self.shardings)
        root, latest = self.checkpointer.root, self.checkpointer.latest_step()
        meta = read_meta(root, latest) if latest is not None else None
        if meta is not None:
            check_same_model(meta, self.meta.get("model"), self.meta["config"], cfg.optimizer,
                             os.path.join(root, str(latest)))
        if meta is not None and "optimizer" in meta:
            self._resume(latest, target)
        else:
            if meta is not None:  # a params-only checkpoint (import-hf): start from its params
                self.init_params = functools.partial(restore_params, root, latest)
            self._init(sample, target)
        self.last_saved = latest  # the newest checkpoint on disk
        nan_at = -1 if cfg.debug_nan_at_step is None else cfg.debug_nan_at_step
        self._nan_at = jax.device_put(np.int32(nan_at), replicated(mesh))
        self._eval_start = self.eval_data.state() if self.eval_data is not None else None
        self._compile(target)

    def _resume(self, step: int, target) -> None:
        self.state, data = self.checkpointer.restore(step, target)
        self.train_data.restore(data["train"])
        self.rng = jax.device_put(np.asarray(data["rng"], np.uint32), replicated(self.mesh))
        self.nonfinite_skipped = int(data.get("nonfinite_skipped", 0))
        self.start_step = step
        say(f"resumed from {os.path.join(self.checkpointer.root, str(step))}")

    def _init(self, sample, target) -> None:
        key, init_key = np.asarray(jax.random.split(jax.random.PRNGKey(self.cfg.seed)), np.uint32)
        params = self.init_params(target.params) if self.init_params else None
        self.state = init_state(self.module, sample, self.tx, init_key, self.shardings, self.mesh,
                                self.rules, params=params)
        self.rng = jax.device_put(key, replicated(self.mesh))
        self.start_step = 0

    def _compile(self, target) -> None:
        cfg = self.cfg
        step_fn = functools.partial(
            train_step, module=self.module, tx=self.tx, schedule=self.schedule,
            grad_accum=cfg.grad_accum, skip_nonfinite=cfg.skip_nonfinite,
        )
        batch_shardings = {k: self.batch_sharding for k in BATCH_KEYS}
        abstract_batch = {
            k: jax.ShapeDtypeStruct(self.batch_shape, BATCH_DTYPES.get(k, np.int32), sharding=self.batch_sharding)
            for k in BATCH_KEYS
        }
        scalar = replicated(self.mesh)
        jitted = jax.jit(step_fn, in_shardings=(self.shardings, batch_shardings, scalar, scalar),
                         out_shardings=(self.shardings, scalar), donate_argnums=0)
        t0 = time.perf_counter()
        with activate(self.mesh, self.rules):
            args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=scalar) for x in (self.rng, self._nan_at)]
            self._train_step = compile_cached(jitted, target, abstract_batch, *args, mesh=self.mesh)
        self.compile_seconds = time.perf_counter() - t0
        self._abstract_batch = abstract_batch
        self._eval_step = None  # compiled at the first evaluation

    def describe(self) -> str:
        """What one device holds of the params and of the optimizer state."""
        s, sh = self.state, self.shardings
        total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(s.params))
        return (
            f"mesh {describe_mesh(self.mesh)}: params {_mib(total)} in all, "
            f"{_mib(per_device_bytes(s.params, sh.params))} per device; optimizer state "
            f"{_mib(per_device_bytes(s.opt_state, sh.opt_state))} per device"
            + (f" (rules {self.opt_rules.name})" if self.opt_rules is not None else "")
        )

    # ------------------------------------------------------------------ steps
    def train_step(self, state, batch) -> tuple:
        """One compiled step: ``(new_state, metrics)``; ``state`` is donated."""
        return self._train_step(state, self.place(batch), self.rng, self._nan_at)

    def place(self, batch) -> dict:
        """The batch's arrays as global jax.Arrays with the batch sharding."""
        out = {}
        for k in BATCH_KEYS:
            v = batch[k]
            if isinstance(v, jax.Array):
                out[k] = v if v.sharding == self.batch_sharding else jax.device_put(v, self.batch_sharding)
            else:
                local = np.asarray(v, BATCH_DTYPES.get(k, np.int32))
                out[k] = jax.make_array_from_process_local_data(self.batch_sharding, local, self.batch_shape)
        return out

    def evaluate(self) -> dict:
        """Loss, perplexity and token accuracy over the first ``eval_steps`` held-out batches."""
        if self.eval_data is None:
            return {}
        self.eval_data.restore(self._eval_start)
        with activate(self.mesh, self.rules):
            if self._eval_step is None:
                jitted = jax.jit(functools.partial(eval_step, module=self.module),
                                 in_shardings=(self.shardings.params, self.batch_sharding),
                                 out_shardings=replicated(self.mesh))
                self._eval_step = compile_cached(jitted, self._abstract_params(), self._abstract_batch,
                                                 mesh=self.mesh)
            totals = None
            for i, batch in enumerate(self.eval_data):
                if i >= self.cfg.eval_steps:
                    break
                out = self._eval_step(self.state.params, self.place(batch))
                totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
        return summarize_eval(jax.device_get(totals)) if totals is not None else {}

    def _abstract_params(self):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            self.state.params)

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
        self.logger = MetricsLogger(cfg.out, cfg.steps, self.start_step, cfg.tensorboard, is_main_process())
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
        try:
            self._loop(end)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            self.checkpointer.close()
            self.logger.close()
        return self.history

    def _loop(self, end: int) -> None:
        cfg, step = self.cfg, self.start_step
        tokens_per_step = cfg.batch_size * cfg.seq_len
        timer = _StepTimer()
        pending = None  # (step, metrics) of a step whose finiteness is not checked yet
        while step < end and not self._stop_requested():
            try:
                batch = next(self.train_data)
            except StopIteration:
                say(f"the training data ran out after step {step}")
                break
            record = {"batch_hash": batch_hash(batch)} if cfg.debug_batch_hash else {}
            self.state, metrics = self.train_step(self.state, batch)
            step += 1
            timer.steps += 1
            if pending is not None:  # the previous step's flag: ready without waiting for this step
                self._check_finite(*pending)
            pending = (step, metrics)
            self.logger.advance()
            if cfg.debug_step_delay:
                time.sleep(cfg.debug_step_delay)
            if step % cfg.log_every == 0 or step in (1, end):  # step 1: the loss at the start
                self._check_finite(*pending)
                pending = None
                record.update(_scalars(jax.device_get(metrics)), **timer.lap(tokens_per_step))
                if cfg.skip_nonfinite:
                    record["nonfinite_skipped"] = self.nonfinite_skipped
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                with timer.paused():
                    record.update(self.evaluate())
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
            say(f"SIGTERM: saving a checkpoint at step {step} and stopping")
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

    def lap(self, tokens_per_step: int) -> dict:
        now = time.perf_counter()
        step_time = (now - self.start - self.excluded) / max(self.steps, 1)
        self.start, self.steps, self.excluded = now, 0, 0.0
        return {"step_time_s": step_time, "tokens_per_sec": tokens_per_step / step_time}


def _scalars(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items() if k != "finite"}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"

