"""The one program: abstract train state, its shardings, and the compiled steps.

Built from a model config, a rule table, a mesh, an optimizer and a task, a ``Program`` does ONE
``jax.eval_shape`` of the whole train state (params from ``module.init``, optimizer state from
``tx.init`` on the still-boxed params, so it carries their logical axes) under the rules and
validates params and activations strictly. Every sharding comes from that one trace: the
params' from their logical axes under ``rules``, the optimizer state's from the same axes under
``opt_rules`` (ZeRO-1 is ``rules=dp, opt_rules=zero1``). A model with LoRA adapters trains only
them: the optimizer state holds the adapters alone, the step differentiates only them.

The model is built with the program's ``Placement`` (mesh and rules), never a context; the
activation constraints validated are recorded from an abstract trace of the step that compiles.

Every jit goes through ``Program.compile`` (``jit.compile_on``): the init, the train and eval
steps, each task's steps, scoring, and decoding (``program.decoding``, ``train/decoding.py``).
The Trainer, ``plan`` (and ``plan --compile``), advise, the benchmarks, checkpoint loading, HF
import and export, eval and generation all use a Program; nothing else traces ``init``, jits a
step or resolves a logical name. On an ``AbstractMesh`` a program plans but does not compile.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import struct, traverse_util
from jax.sharding import AbstractMesh

from shardzoo.errors import UserError
from shardzoo.models.layers import recording_constraints
from shardzoo.models.lora import join, split
from shardzoo.sharding.mesh import describe_mesh
from shardzoo.sharding.partition import Placement, activate, replicated, spec_to_sharding
from shardzoo.sharding.plan import Plan, make_plan
from shardzoo.sharding.validate import Activation, check, rule_problems, usable_rules
from shardzoo.train import model_info
from shardzoo.train.config import TrainConfig
from shardzoo.train.decoding import Decoding
from shardzoo.train.jit import (
    compile_on,
    count_collectives,
    global_array,
    memory_analysis,
    per_device_bytes,
    with_shardings,
)
from shardzoo.train.optim import make_optimizer
from shardzoo.train.step import (
    eval_step,
    old_logps_step,
    reference_step,
    score_step,
    train_step,
)
from shardzoo.train.tasks.base import model_task
from shardzoo.train.teacher import Teacher


@struct.dataclass
class TrainState:
    """Optimizer steps taken, parameters and optimizer state; a pytree that orbax saves."""

    step: jax.Array  # int32 scalar
    params: Any
    opt_state: Any


def _is_box(x) -> bool:
    return isinstance(x, nn.Partitioned)


def _keep_matching_boxes(tree):
    """Unbox the optimizer-state leaves whose shape no longer matches their param's axes
    (e.g. adafactor's factored rows): they are replicated; the rest keep the param's names."""
    def fix(x):
        if _is_box(x) and not (hasattr(x.value, "ndim") and x.value.ndim == len(x.names)):
            return x.value
        return x

    return jax.tree.map(fix, tree, is_leaf=_is_box)


class Program:
    """The train state's abstract shapes and shardings and the one train and eval step.

    ``optimizer``: ``boxed_params -> (tx, schedule)`` (e.g. ``functools.partial(make_optimizer,
    settings)``); None builds a params-only program (import, export, decoding). ``batch_size``
    is the global batch of one step, split into ``grad_accum`` microbatches; the model is
    traced on one microbatch. ``strict=False`` turns validation problems into warnings and
    applies what is usable.
    """

    def __init__(self, config, rules, mesh, *, optimizer=None, opt_rules=None, task=None,
                 batch_size: int | None = None, seq_len: int | None = None, grad_accum: int = 1,
                 skip_nonfinite: bool = False, strict: bool = True, reference: str | None = None,
                 teacher=None):
        self.config, self.mesh = config, mesh
        # a preference task's reference model: "copy" (a frozen copy of the params, sharded as
        # they are), "adapters" (a LoRA policy's base: the adapters off), "stored" (reference
        # log-probs precomputed with the run's data), "teacher" (distillation's ``teacher``: a model
        # config of its own, any family with the student's vocabulary), None (no reference)
        self.reference = reference
        self.task = task if task is not None else model_task(config)
        self.batch_size = batch_size or mesh.size
        self.seq_len = seq_len if seq_len is not None else 8
        self.grad_accum, self.skip_nonfinite = grad_accum, skip_nonfinite
        self.tx = self.schedule = None
        self._optimizer = optimizer
        self.trains = config.trains  # None: every param trains
        if self.batch_size % grad_accum:
            raise UserError(f"batch size {self.batch_size} is not divisible by grad_accum {grad_accum}")
        self.micro_batch = self.batch_size // grad_accum
        trace_rules = usable_rules(rules, mesh) if rule_problems(rules, mesh) else rules
        self.placement = Placement(mesh, trace_rules)
        self.module = config.build(self.placement)
        self.fields = self.task.fields(config, self.batch_size, self.seq_len)
        self.batch_shardings = {k: spec_to_sharding(f.names, mesh, trace_rules) for k, f in self.fields.items()}
        self.abstract_batch = {
            k: jax.ShapeDtypeStruct(f.shape, jnp.dtype(f.dtype), sharding=self.batch_shardings[k])
            for k, f in self.fields.items()
        }
        self._check_microbatch(trace_rules)  # before the trace: its one-line error beats the report's

        # ONE trace of the whole train state, then one of the step itself for its constraints.
        with activate(mesh):
            boxed = jax.eval_shape(self._init_state, jax.random.key(0))
            self.boxed_params, self.boxed_opt_state = boxed.params, boxed.opt_state
            with recording_constraints(apply=False) as sites:
                self._trace_step(nn.meta.unbox(boxed))
        self.activation_sites = tuple(
            Activation(f"activations/{path}", names, shape, dtype) for path, names, shape, dtype in sites
        )
        self.report = check({"params": boxed.params}, rules, mesh, activations=self.activation_sites,
                            strict=strict)
        self.rules = self.report.rules
        self.opt_rules = opt_rules
        if opt_rules is not None:
            opt_report = check(boxed.opt_state, opt_rules, mesh, strict=strict)
        else:  # the optimizer state follows its params; their problems were reported above
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt_report = check(boxed.opt_state, self.rules, mesh, strict=False)
        abstract = nn.meta.unbox(boxed)
        self.shardings = TrainState(step=replicated(mesh), params=self.report.shardings(mesh)["params"],
                                    opt_state=opt_report.shardings(mesh))
        self.abstract = with_shardings(abstract, self.shardings)
        self._train_step = self._eval_step = self._score_step = self._reference_step = None
        self._old_logps_step = None
        # distillation's teacher (a model config, any family with the student's vocabulary)
        self.teacher = Teacher(self, teacher, strict) if teacher is not None else None
        self.reward_model = None  # GRPO's --reward-model: its own params-only Program (tasks/reward.py)
        self.compile_seconds = None  # how long the train step took to compile (once compiled)

    # ------------------------------------------------------------------ the one init
    def _sample_inputs(self):
        return [jnp.zeros(s.shape, s.dtype) for s in self.config.sample_inputs(self.micro_batch, self.seq_len)]

    def _init_params(self, rng):
        rngs = {"params": rng, "dropout": rng, "jitter": rng}
        return self.module.init(rngs, *self._sample_inputs(), deterministic=True)["params"]

    def _init_state(self, rng):
        """The boxed train state at step 0 (traced by ``eval_shape`` and, unboxed, by ``init``)."""
        return self._state_from(self._init_params(rng))

    def _state_from(self, params):
        trained, _ = split(params, self.trains)
        if self._optimizer is not None and self.tx is None:  # built once, from the traced names
            self.tx, self.schedule = self._optimizer(trained)
        opt_state = _keep_matching_boxes(self.tx.init(trained)) if self.tx is not None else None
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)

    def _trace_step(self, abstract_state) -> None:
        """An abstract trace of the step this program compiles (the train step, or the eval
        step without an optimizer): every activation constraint it makes is recorded."""
        rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
        if self.tx is not None:
            jax.eval_shape(self._train_fn(), abstract_state, self.abstract_batch, rng)
        else:
            jax.eval_shape(functools.partial(eval_step, module=self.module, task=self.task),
                           abstract_state.params, self.abstract_batch)

    def init(self, rng, params=None) -> TrainState:
        """A TrainState at step 0, created sharded by one jit; ``params`` (placed like
        ``params_target()``) replaces the random init; when it lacks leaves (LoRA adapters over
        an imported base), those come from the random init."""
        with activate(self.mesh):
            given = set(traverse_util.flatten_dict(params)) if params is not None else set()
            wanted = traverse_util.flatten_dict(self.shardings.params)
            if params is not None and given != set(wanted):
                shardings = traverse_util.unflatten_dict({k: wanted[k] for k in given})
                fn = self.compile(lambda key, p: nn.meta.unbox(self._state_from(join(p, self._init_params(key)))),
                                  rng, params, in_shardings=(None, shardings), out_shardings=self.shardings,
                                  fast=True)
                return fn(rng, params)
            if params is not None:
                fn = self.compile(lambda p: nn.meta.unbox(self._state_from(p)), params,
                                  in_shardings=(self.shardings.params,), out_shardings=self.shardings)
                return fn(params)
            fn = self.compile(lambda key: nn.meta.unbox(self._init_state(key)), rng, out_shardings=self.shardings,
                              fast=True)
            return fn(rng)

    def params_target(self):
        """The params as ShapeDtypeStructs with their shardings (restore and import targets)."""
        return self.abstract.params

    # ------------------------------------------------------------------ steps
    def _check_microbatch(self, rules) -> None:
        spec = self.batch_shardings["weights"].spec
        names = spec[0] if len(spec) else None
        names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
        shards = math.prod(dict(zip(self.mesh.axis_names, self.mesh.axis_sizes, strict=True))[n]
                           for n in names)
        if self.micro_batch % shards:
            raise UserError(
                f"microbatch of {self.micro_batch} rows (batch size {self.batch_size} / grad_accum "
                f"{self.grad_accum}) is not divisible by the {shards} devices that rules "
                f"{getattr(rules, 'name', '')!r} shard the batch over on mesh {describe_mesh(self.mesh)}"
            )

    def _train_fn(self):
        return functools.partial(train_step, module=self.module, task=self.task, tx=self.tx,
                                 schedule=self.schedule, grad_accum=self.grad_accum,
                                 skip_nonfinite=self.skip_nonfinite, trains=self.trains)

    def compile(self, fn, *args, in_shardings=None, out_shardings=None, donate_argnums=(), fast: bool = False,
                options=None):
        """The one jit site: ``fn`` jitted with these shardings, lowered on ``args`` (arrays or
        ShapeDtypeStructs) under this program's mesh, and compiled (``compile_on``, with the
        compiler ``options``)."""
        return compile_on(self.mesh, fn, *args, in_shardings=in_shardings, out_shardings=out_shardings,
                          donate_argnums=donate_argnums, fast=fast, options=options)

    def compiled_train_step(self):
        """The compiled train step (compiled once per Program): ``(state, batch, rng) ->
        (new_state, metrics)``, ``state`` donated."""
        if self.tx is None:
            raise ValueError("a params-only Program (no optimizer) has no train step")
        if self._train_step is None:
            t0 = time.perf_counter()
            scalar = replicated(self.mesh)
            self._train_step = self.compile(self._train_fn(), self.abstract, self.abstract_batch, jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=scalar),
                                            in_shardings=(self.shardings, self.batch_shardings, scalar),
                                            out_shardings=(self.shardings, scalar), donate_argnums=0)
            self.compile_seconds = time.perf_counter() - t0
        return self._train_step

    def _compile_params_step(self, step):
        """``step(params, batch, module, task)`` compiled: ``(params, batch) -> replicated outputs``."""
        return self.compile(functools.partial(step, module=self.module, task=self.task), self.abstract.params,
                            self.abstract_batch, in_shardings=(self.shardings.params, self.batch_shardings),
                            out_shardings=replicated(self.mesh))

    def compiled_eval_step(self):
        """The compiled eval step: ``(params, batch) -> sums`` (see ``tasks.Task.sums``)."""
        if self._eval_step is None:
            self._eval_step = self._compile_params_step(eval_step)
        return self._eval_step

    def compiled_score_step(self):
        """The compiled scoring step: ``(params, batch) -> {logprob, greedy}`` per row: each
        row's summed log-probability of its weighted targets, and whether every one of them is
        the greedy guess (multiple choice, ``train/evaluate.py``)."""
        if self._score_step is None:
            self._score_step = self._compile_params_step(score_step)
        return self._score_step

    def compiled_reference_step(self):
        """The compiled reference step of a preference task: ``(params, batch) -> {ref_logps}``,
        the batch without its reference entries. ``params``: the reference's (a frozen copy,
        placed as the params), or with ``reference="adapters"`` the policy's own (its LoRA
        adapters are switched off inside the step). Distillation: the teacher's step."""
        if self.teacher is not None:
            return self.teacher.compiled_step()
        if self._reference_step is None:
            keys = self.task.reference_keys
            fn = functools.partial(reference_step, module=self.module, task=self.task,
                                   adapters_off=bool(model_info.lora_rank(self.config)))
            self._reference_step = self.compile_filler(fn, keys)
        return self._reference_step

    def compiled_old_logps_step(self):
        """GRPO's compiled old-policy step: ``(params, batch) -> {old_logps}`` per token, the
        batch without its later entries (``task.later_keys``)."""
        if self._old_logps_step is None:
            fn = functools.partial(old_logps_step, module=self.module, task=self.task)
            self._old_logps_step = self.compile_filler(fn, ("old_logps",))
        return self._old_logps_step

    def compile_filler(self, fn, keys, params=None, params_shardings=None):
        """``fn(params, batch) -> {key: array for keys}``, compiled for the batch without
        ``task.later_keys`` (those a batch holds already are left out of the call); ``params``
        and their shardings: this program's, or another model's (the teacher's)."""
        later = self.task.later_keys
        batch = {k: v for k, v in self.batch_shardings.items() if k not in later}
        params = self.abstract.params if params is None else params
        params_shardings = self.shardings.params if params_shardings is None else params_shardings
        abstract = {k: v for k, v in self.abstract_batch.items() if k not in later}
        compiled = self.compile(fn, params, abstract, in_shardings=(params_shardings, batch),
                                out_shardings={k: self.batch_shardings[k] for k in keys})
        return lambda params, placed: compiled(params, {k: v for k, v in placed.items() if k not in later})

    def reference_bytes(self) -> int | None:
        """What the reference model costs one device: a frozen copy's parameters, else 0 (the
        base under LoRA's adapters, or stored log-probs); None without a reference."""
        if self.teacher is not None:  # distillation: the frozen teacher's params
            return self.teacher.param_bytes()
        if not self.task.reference_keys or self.reference is None:
            return None
        return per_device_bytes(self.abstract.params, self.shardings.params) if self.reference == "copy" else 0

    def place_global(self, batch) -> dict:
        """``place`` of a batch every process holds whole (GRPO's rollouts, sampled and scored
        the same on every process): each device takes its rows of the global arrays."""
        return self.place({k: global_array(np.asarray(v, self.fields[k].dtype), self.batch_shardings[k])
                           if k in self.fields and not isinstance(v, jax.Array) else v for k, v in batch.items()})

    def place(self, batch) -> dict:
        """The batch's arrays as global jax.Arrays with the batch shardings (host data is this
        process's rows); a preference batch may lack its reference entries."""
        out = {}
        for k, field in self.fields.items():
            if k not in batch and k in self.task.later_keys:
                continue  # the reference (or old-policy) step fills it in
            v, sharding = batch[k], self.batch_shardings[k]
            if isinstance(v, jax.Array):
                out[k] = v if v.sharding == sharding else jax.device_put(v, sharding)
            else:
                local = np.asarray(v, field.dtype)
                out[k] = jax.make_array_from_process_local_data(sharding, local, field.shape)
        return out

    # ------------------------------------------------------------------ what it costs
    def compile_report(self) -> dict:
        """XLA's per-device memory and collective counts for the compiled train step, and the
        per-device bytes of the batch (part of ``argument``)."""
        compiled = self.compiled_train_step()
        batch_bytes = per_device_bytes(self.abstract_batch, self.batch_shardings)
        return {"memory": memory_analysis(compiled), "collectives": count_collectives(compiled.as_text()),
                "batch_bytes": batch_bytes}

    def plan(self, *, device_memory=None, name: str | None = None) -> Plan:
        """The sharding plan: every array's placement and the per-device totals."""
        opt = 0 if self.tx is None else per_device_bytes(self.abstract.opt_state, self.shardings.opt_state)
        grads = None  # as the params
        if self.trains is not None:
            trained = split(self.abstract.params, self.trains)[0]
            grads = per_device_bytes(trained, split(self.shardings.params, self.trains)[0])
        seq_len = self.seq_len if self.task.has_sequence else None
        e = getattr(self.config, "execution", None)  # a model of the interface may have none
        workload = dict(batch=self.batch_size, microbatch=self.micro_batch if self.grad_accum > 1 else None,
                        sequence=seq_len, compute=getattr(e, "dtype", None), params=getattr(e, "param_dtype", None),
                        remat=getattr(e, "remat_policy", None), optimizer="none" if self.tx is None else None)
        return make_plan(self.report, self.mesh, self.config, micro_batch=self.micro_batch * self.task.rows_per_example, seq_len=seq_len,
                         optimizer_bytes=opt, gradient_bytes=grads, device_memory=device_memory,
                         name=name, workload=workload, reference_bytes=self.reference_bytes(),
                         rollout_bytes=self.rollout_bytes(), reward_model_bytes=self.reward_model_bytes())

    def rollout_bytes(self) -> int | None:
        """The sampler's decoding cache on one device (GRPO, on-policy GKD), else None; with ``--seq-kd``
        the larger of the student's and the teacher's (a step samples with one of them)."""
        samplers = ([self] if self.task.samples else []) + ([self.teacher.sampler()] if self.task.teacher_samples else [])
        return max((p.decoding.cache_bytes(self.batch_size, self.seq_len) for p in samplers), default=None)

    def reward_model_bytes(self) -> int | None:
        """GRPO's ``--reward-model``: its params' bytes on one device; None without one."""
        rm = self.reward_model
        return None if rm is None else per_device_bytes(rm.abstract.params, rm.shardings.params)

    @functools.cached_property
    def decoding(self) -> Decoding:
        """Prefill and sampling on this program's params (``train/decoding.py``)."""
        return Decoding(self)

    @property
    def is_abstract(self) -> bool:
        return isinstance(self.mesh, AbstractMesh)


def settings_program(cfg, config, rules, mesh, *, opt_rules=None, strict=True, task=None, reference=None,
                     teacher=None) -> Program:
    """The Program of a run's settings (``cfg``: a TrainConfig: its optimizer, batch, sequence
    length and accumulation) for ``task`` (default: the model's own); ``tasks.registry.run_program``
    gives it the run's ``--task``."""
    if task is None and getattr(cfg, "task", None) not in (None, "lm"):
        raise ValueError(f"settings_program trains the model's own task: --task {cfg.task} is "
                         "tasks.registry.run_program's")
    return Program(config, rules, mesh, optimizer=functools.partial(make_optimizer, cfg),
                   opt_rules=opt_rules, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                   grad_accum=cfg.grad_accum, skip_nonfinite=cfg.skip_nonfinite, strict=strict,
                   task=task, reference=reference, teacher=teacher)


def default_optimizer():
    """The optimizer ``shardzoo train`` uses by default (its settings' defaults)."""
    return functools.partial(make_optimizer, TrainConfig())


def plan(config, rules, mesh, *, batch_size: int, seq_len: int | None = None, optimizer="default",
         opt_rules=None, grad_accum: int = 1, strict: bool = True, device_memory=None,
         name: str | None = None) -> Plan:
    """The sharding plan of a model config's train state (``Program(...).plan()``).

    ``rules``: a table or its name/file; ``mesh``: a Mesh, an AbstractMesh or a spec
    (``"fsdp=32,tensor=8"``: abstract when it does not fit the local devices).
    ``optimizer="default"``: what ``shardzoo train`` uses by default; None: params only.
    """
    from shardzoo.sharding.plan import planning_mesh
    from shardzoo.sharding.rules import get_rules

    rules = get_rules(rules)
    opt_rules = get_rules(opt_rules) if opt_rules is not None else None
    mesh = planning_mesh(mesh) if isinstance(mesh, str | dict) else mesh
    optimizer = default_optimizer() if optimizer == "default" else optimizer
    program = Program(config, rules, mesh, optimizer=optimizer, opt_rules=opt_rules,
                      batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum, strict=strict)
    return program.plan(device_memory=device_memory, name=name)
