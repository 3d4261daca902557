"""Ahead-of-time compile of one training step, to check a sharding plan against the compiler.

``compile_train_step`` lowers forward + backward + an adamw update, jitted with the plan's
shardings, on the local devices (fake CPU devices work) and reads the compiler's per-device
memory (``compiled.memory_analysis()``) and its collectives (counted in the HLO text). Nothing
is allocated or run.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from shardzoo.sharding import axes as ax
from shardzoo.sharding.partition import activate, replicated, spec_to_sharding
from shardzoo.sharding.plan import abstract_init
from shardzoo.sharding.validate import check, rule_problems, usable_rules

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective op (sync or ``-start`` async form) the HLO text holds."""
    return {op: len(re.findall(rf"\b{op}(-start)?\(", hlo_text)) for op in COLLECTIVES}


def loss_fn(task: str, outputs, batch):
    """Mean loss: cross-entropy for ``lm``/``classification`` (integer targets), MSE for regression."""
    if task == "regression":
        return jnp.mean((outputs.astype(jnp.float32) - batch["targets"]) ** 2)
    logits = outputs.astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]))


def make_train_step(module, task: str, tx):
    """A pure ``train_step(params, opt_state, batch) -> (params, opt_state, loss)``."""

    def train_step(params, opt_state, batch):
        def loss(p):
            outputs, aux = module.apply(
                {"params": p}, batch["inputs"], deterministic=True, mutable=["losses", "metrics"]
            )
            extra = sum(jnp.sum(x) for x in jax.tree.leaves(aux.get("losses", {})))
            return loss_fn(task, outputs, batch) + extra

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return train_step


def sample_batch(config, batch_size: int, seq_len: int | None) -> dict:
    """Abstract ``inputs`` and ``targets`` for ``config.task``."""
    (inputs,) = config.sample_inputs(batch_size, seq_len)
    if config.task == "lm":
        targets = jax.ShapeDtypeStruct(inputs.shape, jnp.int32)
    elif config.task == "classification":
        targets = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
    else:
        targets = jax.ShapeDtypeStruct((batch_size, config.num_outputs), jnp.float32)
    return {"inputs": inputs, "targets": targets}


def batch_shardings(batch: dict, task: str, rules, mesh):
    """Leading dim over ``batch``'s mesh axes; an LM's second dim over ``length``'s."""
    def one(x):
        names = (ax.BATCH, ax.LENGTH if task == "lm" else None, None, None)[: len(x.shape)]
        return spec_to_sharding(names, mesh, rules)

    return jax.tree.map(one, batch)


@dataclasses.dataclass(frozen=True)
class AotResult:
    memory: dict  # per device: argument, output, temp, alias, total (= argument+output+temp-alias)
    collectives: dict  # op -> count
    batch_bytes: int  # per device, the part of ``argument`` that is the batch
    compiled: object

    def to_dict(self) -> dict:
        return {"memory": self.memory, "collectives": self.collectives, "batch_bytes": self.batch_bytes}


def state_shardings(module, sample_inputs, tx, rules, mesh, *, strict=True):
    """Abstract params and Adam state with their NamedShardings under ``rules`` on ``mesh``.

    Validates first (``validate.check``); returns (params, their shardings, optimizer state,
    its shardings, the rules actually applied).
    """
    trace_rules = usable_rules(rules, mesh) if rule_problems(rules, mesh) else rules
    boxed, sites = abstract_init(module, sample_inputs, trace_rules, mesh)
    param_report = check(boxed, rules, mesh, activations=sites, strict=strict)
    boxed_opt = jax.eval_shape(tx.init, boxed["params"])
    with warnings.catch_warnings():  # problems of the mirrored state were reported for params
        warnings.simplefilter("ignore")
        opt_report = check(boxed_opt, param_report.rules, mesh, strict=False)
    params = nn.meta.unbox(boxed)["params"]
    return (params, param_report.shardings(mesh)["params"], nn.meta.unbox(boxed_opt),
            opt_report.shardings(mesh), param_report.rules)


def compile_train_step(module, config, rules, mesh, batch_size: int, seq_len: int | None,
                       *, learning_rate: float = 1e-3, strict: bool = True) -> AotResult:
    """Lower and compile one adamw train step for ``mesh`` (a concrete mesh of local devices).

    Non-strict mode applies what validation kept (rules naming unknown mesh axes dropped,
    indivisible parameter dims replicated); an activation constraint that does not divide is
    left to XLA, which pads it (seen compiling mlp-mnist's 10 classes over tensor=4).
    """
    tx = optax.adamw(learning_rate)
    inputs = config.sample_inputs(batch_size, seq_len)
    params, p_sh, opt, o_sh, rules = state_shardings(module, inputs, tx, rules, mesh, strict=strict)
    batch = sample_batch(config, batch_size, seq_len)
    b_sh = batch_shardings(batch, config.task, rules, mesh)
    step = jax.jit(
        make_train_step(module, config.task, tx),
        in_shardings=(p_sh, o_sh, b_sh),
        out_shardings=(p_sh, o_sh, replicated(mesh)),
        donate_argnums=(0, 1),
    )
    with activate(mesh, rules):
        compiled = step.lower(params, opt, batch).compile()
    stats = compiled.memory_analysis()
    memory = {}
    if stats is not None:
        for key in ("argument", "output", "temp", "alias"):
            memory[key] = int(getattr(stats, f"{key}_size_in_bytes"))
        memory["total"] = memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]
    batch_bytes = sum(
        int(jnp.dtype(x.dtype).itemsize) * math.prod(s.shard_shape(x.shape))
        for x, s in zip(jax.tree.leaves(batch), jax.tree.leaves(b_sh), strict=True)
    )
    return AotResult(memory, count_collectives(compiled.as_text()), batch_bytes, compiled)
