"""The one program: abstract train state, its shardings, and the jitted train and eval steps.

Built from a model config, a rule table, a mesh, an optimizer and a task, a ``Program`` does ONE
``jax.eval_shape`` of the whole train state (params from ``module.init``, optimizer state from
``tx.init`` on the still-boxed params, so it carries the params' logical axes) under the rules,
recording every activation constraint on the way, and validates params and activations
strictly. Every sharding comes from that one trace: the params' from their logical axes under
``rules``, the optimizer state's from the same axes under ``opt_rules`` (ZeRO-1 is ``rules=dp,
opt_rules=zero1``: one transform, nothing else). It owns the one train step and eval step.
A model with LoRA adapters trains only them: the optimizer is built for, and its state holds,
the adapters alone, and the step differentiates only them (``trains``); the base passes through.

The model is built with the program's ``Placement`` (mesh and rules, ``sharding.partition``):
its activation constraints and explicit ``shard_map`` paths read them from there, never from a
context. The activation constraints the validator checks are recorded from an abstract trace of
the step itself (the train step, or the eval step of a params-only program), so they are those
of the program that compiles: the pipeline's, the ring's and the MoE dispatch's included.

The Program is the one jit site: the train step, the eval step, multiple-choice scoring
(``score_step``) and decoding (``generate``: prefill and the sampling loop, the KV cache
sharded by its logical axes like every other array). The Trainer, ``shardzoo plan`` (and
``plan --compile``), advise, the benchmarks, checkpoint loading, Hugging Face import and export,
eval and generation all use a Program; nothing else traces ``init``, jits a step or resolves a
logical name. A program on an ``AbstractMesh`` (devices you don't have) plans but does not
compile or run.
"""

from __future__ import annotations

import functools
import math
import re
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import struct, traverse_util
from jax.sharding import AbstractMesh, NamedSharding

from shardzoo.errors import UserError
from shardzoo.models.decode import cache_init_fn, generate_tokens, unrolled_params
from shardzoo.models.layers import recording_constraints
from shardzoo.models.lora import join, split
from shardzoo.models.rope import check_rope_decoding
from shardzoo.sharding.mesh import describe_mesh
from shardzoo.sharding.partition import Placement, activate, replicated, spec_to_sharding
from shardzoo.sharding.plan import Plan, make_plan
from shardzoo.sharding.validate import Activation, check, resolve_array, rule_problems, usable_rules
from shardzoo.train.step import (
    eval_step,
    old_logps_step,
    reference_step,
    score_step,
    teacher_step,
    train_step,
)
from shardzoo.train.tasks import get_task

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


@struct.dataclass
class TrainState:
    """Optimizer steps taken, parameters and optimizer state; a pytree that orbax saves."""

    step: jax.Array  # int32 scalar
    params: Any
    opt_state: Any


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective op (sync or ``-start`` async form) the HLO text holds."""
    return {op: len(re.findall(rf"\b{op}(-start)?\(", hlo_text)) for op in COLLECTIVES}


def memory_analysis(compiled) -> dict:
    """Per-device bytes from XLA: argument, output, temp, alias and total."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    memory = {k: int(getattr(stats, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    memory["total"] = memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]
    return memory


def per_device_bytes(tree, shardings) -> int:
    """Bytes one device holds of a tree of arrays (or ShapeDtypeStructs) under ``shardings``."""
    leaves = zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True)
    return sum(jnp.dtype(a.dtype).itemsize * math.prod(s.shard_shape(a.shape)) for a, s in leaves)


def with_shardings(abstract_tree, shardings):
    """ShapeDtypeStructs carrying ``shardings`` (restore targets, lowering arguments)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_tree, shardings)


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


def _compile(lowered, fast: bool = False):
    """Compile; ``fast`` skips LLVM's optimizations for a program that runs once (init), which
    on CPU dominate the compile of threefry-heavy init programs (measured 37 s -> 4 s)."""
    if fast and jax.default_backend() == "cpu":
        return lowered.compile(compiler_options={"xla_backend_optimization_level": 0})
    return lowered.compile()



def global_array(value: np.ndarray, sharding) -> jax.Array:
    """``value`` (the same on every process) as a global array with ``sharding``: each device
    takes its slice (under several processes too, where ``device_put`` of host data would not)."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def host_array(x: jax.Array) -> np.ndarray:
    """A global array's whole value on every process (gathered across processes when its
    shards live on several)."""
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))

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
        self.task = task if task is not None else get_task(config)
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
        self._old_logps_step = self._teacher_step = None
        self._build_teacher(teacher, strict)
        self.compile_seconds = None  # how long the train step took to compile (once compiled)
        self._decoders: dict = {}

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
                fn = jax.jit(lambda key, p: nn.meta.unbox(self._state_from(join(p, self._init_params(key)))),
                             in_shardings=(None, shardings), out_shardings=self.shardings)
                return _compile(fn.lower(rng, params), fast=True)(rng, params)
            if params is not None:
                fn = jax.jit(lambda p: nn.meta.unbox(self._state_from(p)),
                             in_shardings=(self.shardings.params,), out_shardings=self.shardings)
                return fn(params)
            fn = jax.jit(lambda key: nn.meta.unbox(self._init_state(key)), out_shardings=self.shardings)
            return _compile(fn.lower(rng), fast=True)(rng)

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

    def _rng_struct(self):
        return jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated(self.mesh))

    def _train_fn(self):
        return functools.partial(train_step, module=self.module, task=self.task, tx=self.tx,
                                 schedule=self.schedule, grad_accum=self.grad_accum,
                                 skip_nonfinite=self.skip_nonfinite, trains=self.trains)

    def jitted_train_step(self):
        """The train step, jitted with the state's and batch's shardings, state donated."""
        if self.tx is None:
            raise ValueError("a params-only Program (no optimizer) has no train step")
        scalar = replicated(self.mesh)
        return jax.jit(self._train_fn(), in_shardings=(self.shardings, self.batch_shardings, scalar),
                       out_shardings=(self.shardings, scalar), donate_argnums=0)

    def lower(self):
        """The train step lowered for this program's abstract state and batch."""
        with activate(self.mesh):
            return self.jitted_train_step().lower(self.abstract, self.abstract_batch, self._rng_struct())

    def compiled_train_step(self):
        """The compiled train step (compiled once per Program): ``(state, batch, rng) ->
        (new_state, metrics)``, ``state`` donated."""
        if self._train_step is None:
            t0 = time.perf_counter()
            self._train_step = self.lower().compile()
            self.compile_seconds = time.perf_counter() - t0
        return self._train_step

    def compiled_eval_step(self):
        """The compiled eval step: ``(params, batch) -> sums`` (see ``tasks.Task.sums``)."""
        if self._eval_step is None:
            fn = jax.jit(functools.partial(eval_step, module=self.module, task=self.task),
                         in_shardings=(self.shardings.params, self.batch_shardings),
                         out_shardings=replicated(self.mesh))
            with activate(self.mesh):
                self._eval_step = fn.lower(self.abstract.params, self.abstract_batch).compile()
        return self._eval_step

    def compiled_score_step(self):
        """The compiled scoring step: ``(params, batch) -> {logprob, greedy}`` per row: each
        row's summed log-probability of its weighted targets, and whether every one of them is
        the greedy guess (multiple choice, ``train/evaluate.py``)."""
        if self._score_step is None:
            fn = jax.jit(functools.partial(score_step, module=self.module, task=self.task),
                         in_shardings=(self.shardings.params, self.batch_shardings),
                         out_shardings=replicated(self.mesh))
            with activate(self.mesh):
                self._score_step = fn.lower(self.abstract.params, self.abstract_batch).compile()
        return self._score_step

    def compiled_reference_step(self):
        """The compiled reference step of a preference task: ``(params, batch) -> {ref_logps}``,
        the batch without its reference entries. ``params``: the reference's (a frozen copy,
        placed as the params), or with ``reference="adapters"`` the policy's own (its LoRA
        adapters are switched off inside the step). Distillation: the teacher step."""
        if self.teacher_config is not None:
            return self.compiled_teacher_step()
        if self._reference_step is None:
            keys = self.task.reference_keys
            fn = functools.partial(reference_step, module=self.module, task=self.task,
                                   adapters_off=bool(getattr(self.config, "lora_rank", 0)))
            self._reference_step = self._compile_filler(fn, keys)
        return self._reference_step

    def compiled_old_logps_step(self):
        """GRPO's compiled old-policy step: ``(params, batch) -> {old_logps}`` per token, the
        batch without its later entries (``task.later_keys``)."""
        if self._old_logps_step is None:
            fn = functools.partial(old_logps_step, module=self.module, task=self.task)
            self._old_logps_step = self._compile_filler(fn, ("old_logps",))
        return self._old_logps_step

    def _compile_filler(self, fn, keys, params=None, params_shardings=None):
        """``fn(params, batch) -> {key: array for keys}``, compiled for the batch without
        ``task.later_keys`` (those a batch holds already are left out of the call); ``params``
        and their shardings: this program's, or another model's (the teacher's)."""
        later = self.task.later_keys
        batch = {k: v for k, v in self.batch_shardings.items() if k not in later}
        params = self.abstract.params if params is None else params
        params_shardings = self.shardings.params if params_shardings is None else params_shardings
        jitted = jax.jit(fn, in_shardings=(params_shardings, batch),
                         out_shardings={k: self.batch_shardings[k] for k in keys})
        abstract = {k: v for k, v in self.abstract_batch.items() if k not in later}
        with activate(self.mesh):
            compiled = jitted.lower(params, abstract).compile()
        return lambda params, placed: compiled(params, {k: v for k, v in placed.items() if k not in later})

    def _build_teacher(self, teacher, strict) -> None:
        """Distillation's teacher (a model config, any family with the student's vocabulary):
        its module on this program's placement and its frozen params' abstract shapes and
        shardings, from one trace of its init under the same rules."""
        self.teacher_config = teacher
        if teacher is None:
            return
        from shardzoo.train.distill import check_vocab

        self.teacher_config = teacher = check_vocab(self.config, teacher)
        self.teacher_module = teacher.build(self.placement)
        inputs = [jnp.zeros(s.shape, s.dtype) for s in teacher.sample_inputs(self.micro_batch, self.seq_len)]

        def init(rng):
            return self.teacher_module.init({"params": rng}, *inputs, deterministic=True)["params"]

        with activate(self.mesh):
            boxed = jax.eval_shape(init, jax.random.key(0))
        report = check({"teacher": boxed}, self.rules, self.mesh, strict=strict)  # its paths: teacher/...
        self.teacher_shardings = report.shardings(self.mesh)["teacher"]
        self.teacher_target = with_shardings(nn.meta.unbox(boxed), self.teacher_shardings)

    def compiled_teacher_step(self):
        """Distillation's compiled teacher step: ``(teacher_params, batch) -> {teacher_logits}``,
        the batch without its later entries; the teacher's params placed as ``teacher_target``."""
        if self._teacher_step is None:
            fn = functools.partial(teacher_step, module=self.teacher_module, task=self.task)
            self._teacher_step = self._compile_filler(fn, ("teacher_logits",), params=self.teacher_target,
                                                      params_shardings=self.teacher_shardings)
        return self._teacher_step

    def reference_bytes(self) -> int | None:
        """What the reference model costs one device: a frozen copy's parameters, else 0 (the
        base under LoRA's adapters, or stored log-probs); None without a reference."""
        if self.teacher_config is not None:  # distillation: the frozen teacher's params
            return per_device_bytes(self.teacher_target, self.teacher_shardings)
        if not self.task.reference_keys or self.reference is None:
            return None
        return per_device_bytes(self.abstract.params, self.shardings.params) if self.reference == "copy" else 0

    # ------------------------------------------------------------------ decoding
    @property
    def _scan_decoding(self) -> bool:
        return self.config.execution.decode_layers == "scan"

    @functools.cached_property
    def decoder(self):
        """The module decoding runs: with ``decode_layers="unroll"`` this model with its layers
        unrolled (``models.decode.unrolled_params``), with "scan" the model as built."""
        return self.module if self._scan_decoding else self.config.replace(scan_layers=False).build(self.placement)

    def decoding_params(self, params):
        """``params`` as decoding takes them (``self.decoder``: every layer unrolled, or as they are)."""
        return params if self._scan_decoding else unrolled_params(self.config.layout(), params)

    def cache_shardings(self, batch_size: int, max_length: int):
        """``(abstract cache, shardings)`` of the decoding cache for ``batch_size`` rows of
        ``max_length`` positions (``decode_layers="unroll"``: one per layer, ``layers_i``;
        "scan": a scanned stack's with a leading ``layers`` axis, an unrolled layer's its own):
        its arrays' logical axes under the rules, like every array."""
        init = cache_init_fn(self.decoder, batch_size, max_length)
        with activate(self.mesh):
            boxed = jax.eval_shape(lambda p: init(self.decoding_params(p)), self.abstract.params)
        report = check(boxed, self.rules, self.mesh, strict=False)
        return nn.meta.unbox(boxed), report.shardings(self.mesh)

    def new_cache(self, batch_size: int, max_length: int):
        """An empty decoding cache (zeros, index 0), each array created sharded as its logical
        axes say (``cache_shardings``)."""
        shapes, shardings = self.cache_shardings(batch_size, max_length)
        make = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                       out_shardings=shardings)
        with activate(self.mesh):
            return make()

    def generate(self, params, prompt, prompt_lengths=None, *, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_ids=(), pad_id: int | None = None,
                 key=None):
        """Continue ``prompt`` int32 [batch, prompt_len] (left-padded; ``prompt_lengths`` each
        row's real length, default all) by ``max_new_tokens``: prefill and the sampling loop in
        one compiled program, params, prompt and cache sharded under the rules (compiled once per
        shape and sampling settings). Greedy at temperature 0. Returns int32 [batch, prompt_len +
        max_new_tokens] on the host; rows end at an eos id, padded with ``pad_id`` (default the
        first eos id, else 0). ``key``: the sampler's raw key (uint32 [2]) in place of ``seed``'s."""
        prompt = np.asarray(prompt, np.int32)
        if prompt.ndim != 2:
            raise UserError(f"a prompt must be [batch, prompt_len] tokens, got shape {prompt.shape}")
        vocab = self.config.arch.vocab_size
        if top_k < 0 or top_k > vocab:
            raise UserError(f"top-k {top_k} must be between 0 (off) and the model's vocab_size {vocab}")
        eos_ids = tuple(int(e) for e in eos_ids)
        pad_id = (eos_ids[0] if eos_ids else 0) if pad_id is None else int(pad_id)
        lengths = np.full(prompt.shape[:1], prompt.shape[1], np.int32) if prompt_lengths is None \
            else np.asarray(prompt_lengths, np.int32)
        check_rope_decoding(self.config.arch, int(lengths.max(initial=0)), int(max_new_tokens))
        settings = (prompt.shape, int(max_new_tokens), float(temperature), int(top_k), float(top_p), eos_ids, pad_id)
        if settings not in self._decoders:
            self._decoders[settings] = self._compile_generate(prompt.shape, *settings[1:])
        fn, (prompt_sharding, rows_sharding) = self._decoders[settings]
        key = np.asarray(jax.random.key_data(jax.random.key(seed)) if key is None else key, np.uint32)
        args = (global_array(prompt, prompt_sharding), global_array(lengths, rows_sharding),
                global_array(key, replicated(self.mesh)))
        return host_array(fn(params, *args))

    def _divisible_sharding(self, shape, names):
        resolved, _ = resolve_array("decode", shape, "int32", names, self.rules, self.mesh, param=False)
        return NamedSharding(self.mesh, resolved.spec)

    def _compile_generate(self, shape, max_new_tokens, temperature, top_k, top_p, eos_ids, pad_id):
        batch, prompt_len = shape
        shapes, cache_shardings = self.cache_shardings(batch, prompt_len + max_new_tokens)
        # rows split as the rules say when they divide (a batch of one prompt: replicated)
        tokens = self._divisible_sharding((batch, prompt_len + max_new_tokens), ("batch", None))
        rows = self._divisible_sharding((batch,), ("batch",))

        def run(params, prompt, lengths, key_data):
            cache = jax.tree.map(lambda s, sh: jax.lax.with_sharding_constraint(jnp.zeros(s.shape, s.dtype), sh),
                                 shapes, cache_shardings)
            return generate_tokens(self.decoder, self.decoding_params(params), cache, prompt, lengths,
                                   jax.random.wrap_key_data(key_data),
                                   max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, eos_ids=eos_ids, pad_id=pad_id)

        prompt = self._divisible_sharding(shape, ("batch", None))
        fn = jax.jit(run, in_shardings=(self.shardings.params, prompt, rows, replicated(self.mesh)),
                     out_shardings=tokens)
        args = (self.abstract.params, jax.ShapeDtypeStruct(shape, jnp.int32, sharding=prompt),
                jax.ShapeDtypeStruct(shape[:1], jnp.int32, sharding=rows),
                jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated(self.mesh)))
        with activate(self.mesh):
            return fn.lower(*args).compile(), (prompt, rows)

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
        seq_len = self.seq_len if self.task.name in ("lm", "dpo", "kto", "grpo", "rloo", "reward", "distill") else None
        e = getattr(self.config, "execution", None)  # a model of the interface may have none
        workload = dict(batch=self.batch_size, microbatch=self.micro_batch if self.grad_accum > 1 else None,
                        sequence=seq_len, compute=getattr(e, "dtype", None), params=getattr(e, "param_dtype", None),
                        remat=getattr(e, "remat_policy", None), optimizer="none" if self.tx is None else None)
        rows = 2 if self.task.name in ("dpo", "kto") else 1  # a pair (kto: a row and its KL row): two sequences
        return make_plan(self.report, self.mesh, self.config, micro_batch=self.micro_batch * rows, seq_len=seq_len,
                         optimizer_bytes=opt, gradient_bytes=grads, device_memory=device_memory,
                         name=name, workload=workload, reference_bytes=self.reference_bytes(),
                         rollout_bytes=self.rollout_bytes())

    def rollout_bytes(self) -> int | None:
        """GRPO: what the decoding cache that samples a step's completions (a batch of
        ``seq_len`` positions) costs one device; None for other tasks."""
        if self.task.name not in ("grpo", "rloo"):
            return None
        return per_device_bytes(*self.cache_shardings(self.batch_size, self.seq_len))

    @property
    def is_abstract(self) -> bool:
        return isinstance(self.mesh, AbstractMesh)



def run_program(cfg, config, rules, mesh, *, opt_rules=None, strict=True) -> Program:
    """The Program of a training run's settings (``cfg``: a TrainConfig): the one that
    ``shardzoo train`` steps and ``shardzoo plan --compile`` compiles."""
    from shardzoo.train.grpo import rollout_layout
    from shardzoo.train.optim import make_optimizer
    from shardzoo.train.preference import run_task

    task, reference = run_task(cfg, config)
    config = rollout_layout(cfg, config)  # GRPO: rollouts decode the params in place
    teacher = None
    if reference == "teacher":  # distillation: the teacher's own model, any family
        from shardzoo.train.distill import teacher_config

        teacher = teacher_config(cfg.teacher)
    return Program(config, rules, mesh, optimizer=functools.partial(make_optimizer, cfg),
                   opt_rules=opt_rules, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                   grad_accum=cfg.grad_accum, skip_nonfinite=cfg.skip_nonfinite, strict=strict,
                   task=task, reference=reference, teacher=teacher)


def default_optimizer():
    """The optimizer ``shardzoo train`` uses by default (its settings' defaults)."""
    from shardzoo.train.config import TrainConfig
    from shardzoo.train.optim import make_optimizer

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
