"""Pure train and eval steps; ``train/program.py`` jits them with shardings and donation.

The loss is the task's weighted loss (sum of weighted per-token or per-example losses over the
sum of weights) plus the sum of every leaf of the model's ``"losses"`` collection (MoE
auxiliary losses, already weighted). Gradient accumulation scans over K microbatches; each
microbatch contributes ``weighted_loss_sum / total_weight + aux / K`` with the total weight of
the whole batch, so K microbatches give the gradient of one step on the whole batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from shardzoo.models.lora import join, split
from shardzoo.models.tiled_loss import token_stats
from shardzoo.train.tasks.base import forward


def split_microbatches(batch, k: int):
    """``[batch, length]`` leaves to ``[k, batch/k, length]``; microbatch j holds rows j, j+k, ...

    Strided rows keep every device's share of each microbatch local when ``batch`` is sharded.
    """
    def split(x):
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, batch)


def reduce_sums(sums_k: dict) -> dict:
    """The step's sums from its microbatches' ``[k]`` sums: ``min_*`` / ``max_*`` entries (a task's
    extremes, e.g. the reward task's ``min_reward``) by their min / max, the rest summed."""
    ops = {"min_": jnp.min, "max_": jnp.max}
    return {k: ops.get(k[:4], jnp.sum)(v) for k, v in sums_k.items()}


def merge_sums(a: dict, b: dict) -> dict:
    """Two batches' sums as one's (``reduce_sums`` for evaluation's running totals, on the host)."""
    ops = {"min_": min, "max_": max}
    return {k: ops.get(k[:4], lambda x, y: x + y)(a[k], b[k]) for k in a}


def train_step(state, batch, rng, *, module, task, tx, schedule, grad_accum=1, skip_nonfinite=False,
               trains=None):
    """One optimizer step on ``batch``: ``(new_state, metrics)``.

    ``rng`` is the run's base key; dropout draws from ``fold_in(rng, step)``. With
    ``skip_nonfinite`` a step whose loss or gradient norm is not finite keeps the old params
    and optimizer state (the step counter still advances). ``trains`` (a predicate on param
    paths, e.g. LoRA's adapters; None: all) picks the params that are differentiated and
    updated, and that ``state.opt_state`` is for; the others pass through untouched.
    """
    step = state.step + 1  # the number of this step, 1-based
    step_rng = jax.random.fold_in(rng, state.step)
    total_weight = jnp.maximum(jnp.sum(batch["weights"].astype(jnp.float32)), 1e-8)
    totals = task.step_totals(batch)  # e.g. the step's tokens a per-token term divides by

    trained, frozen = split(state.params, trains)
    rate = float(getattr(getattr(module, "config", None), "router_bias_update_rate", 0.0) or 0.0)

    def objective(trained, mb, mb_rng):
        params = join(trained, frozen)
        if rate:
            outputs, aux, model_metrics, extra = forward(task, module, params, mb, mb_rng, deterministic=False,
                                                         extra=("router_load",))
            model_metrics = {**model_metrics, "router_load": extra["router_load"]}
        else:
            outputs, aux, model_metrics = forward(task, module, params, mb, mb_rng, deterministic=False)
        sums = task.sums(outputs, mb) if totals is None else task.sums(outputs, mb, totals)
        obj = sums["loss"] / total_weight + (0.0 if aux is None else aux / grad_accum)
        return obj, (sums, aux, model_metrics)

    grad_fn = jax.value_and_grad(objective, has_aux=True)
    if grad_accum == 1:
        (loss, (sums, aux, model_metrics)), grads = grad_fn(trained, batch, step_rng)
    else:
        def body(grads_acc, xs):
            mb, i = xs
            out, grads = grad_fn(trained, mb, jax.random.fold_in(step_rng, i))
            return jax.tree.map(jnp.add, grads_acc, grads), out

        zeros = jax.tree.map(jnp.zeros_like, trained)
        micro = (split_microbatches(batch, grad_accum), jnp.arange(grad_accum))
        grads, (objs, (sums_k, auxes, metrics_k)) = jax.lax.scan(body, zeros, micro)
        loss, sums = jnp.sum(objs), reduce_sums(sums_k)
        aux = None if auxes is None else jnp.mean(auxes)
        loads = metrics_k.pop("router_load", None)  # [k, ...]: each microbatch's shares
        model_metrics = jax.tree.map(jnp.mean, metrics_k)
        if loads is not None:
            model_metrics["router_load"] = jax.tree.map(lambda x: x.mean(0), loads)

    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, trained)
    new_trained = optax.apply_updates(trained, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if skip_nonfinite:
        keep = lambda new, old: jnp.where(finite, new, old)
        new_trained = jax.tree.map(keep, new_trained, trained)
        opt_state = jax.tree.map(keep, opt_state, state.opt_state)
    new_params = join(new_trained, frozen)
    if rate:
        loads = model_metrics.pop("router_load")
        new_params, violation = balance_router_bias(new_params, loads, rate)
        if skip_nonfinite:
            new_params = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_params, state.params)
    new_state = state.replace(step=step, params=new_params, opt_state=opt_state)
    metrics = {
        "loss": loss,
        task.loss_name: sums["loss"] / total_weight,
        task.weight_name: total_weight,
        "grad_norm": grad_norm,
        "learning_rate": schedule(state.step),
        "finite": finite,
    }
    if "correct" in sums:
        metrics["accuracy"] = sums["correct"] / total_weight
    metrics.update(task.extra_metrics(sums, total_weight))
    if aux is not None:
        metrics["aux_loss"] = aux
    metrics.update(model_metrics)
    if rate:
        metrics["expert_load_max_violation"] = violation
    return new_state, metrics


def balance_router_bias(params, loads, rate: float):
    """DeepSeek-V3's auxiliary-loss-free balancing, outside the gradient: each MoE layer's
    ``moe/router_bias`` [expert] moves by ``rate * sign(1/E - load)`` (up for an expert that took
    less than its share of the step's (token, choice) pairs, down for more), where ``loads``
    (the ``router_load`` collection: ``.../moe/expert_load``, one [..., expert] share per layer
    and microbatch) sits at the bias's path. Returns ``(params, max violation)``: the largest
    ``load / (1/E) - 1`` over experts and layers (DeepSeek's MaxVio; 0 is perfect balance)."""
    flat = {tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey)): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(loads)[0]}
    if not flat:
        raise ValueError("router_bias_update_rate is set but the model returned no expert loads "
                         "(a pipeline-parallel rule table runs the layers without them); set it to 0")
    violations = []

    def update(path, leaf):
        keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        if keys[-2:] != ("moe", "router_bias"):
            return leaf
        load = flat.get(keys[:-1] + ("expert_load",))
        if load is None:
            raise ValueError(f"no expert load recorded for {'/'.join(keys)}")
        share = 1.0 / leaf.shape[-1]
        violations.append(jnp.max(load) / share - 1.0)
        return leaf + rate * jnp.sign(share - load).astype(leaf.dtype)

    params = jax.tree_util.tree_map_with_path(update, params)
    return params, jnp.max(jnp.stack(violations))


def eval_step(params, batch, *, module, task):
    """The task's sums over the batch (weighted loss, weight, correct guesses)."""
    outputs, _, _ = forward(task, module, params, batch, jax.random.PRNGKey(0), deterministic=True)
    return task.sums(outputs, batch)


def reference_step(params, batch, *, module, task, adapters_off=False):
    """The reference model's entries of a preference batch (``task.reference_keys``): its
    summed completion log-probabilities. ``adapters_off``: ``params`` are a LoRA policy's and the
    reference is its base, the adapters' ``lora_b`` set to zero (no second copy of the base)."""
    if adapters_off:
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: jnp.zeros_like(x) if getattr(path[-1], "key", None) == "lora_b" else x, params)
    outputs, _, _ = forward(task, module, params, batch, jax.random.PRNGKey(0), deterministic=True)
    return {"ref_logps": jax.lax.stop_gradient(task.reference_logps(outputs, batch))}


def teacher_step(params, batch, *, module, task):
    """Distillation's teacher entries (``teacher_logits``): the frozen teacher's logits of the
    batch's tokens, ``params`` and ``module`` the teacher's."""
    outputs, _, _ = forward(task, module, params, batch, jax.random.PRNGKey(0), deterministic=True)
    return {"teacher_logits": jax.lax.stop_gradient(outputs.astype(jnp.float32))}


def old_logps_step(params, batch, *, module, task):
    """GRPO's old policy log-probs of a rollout: the per-token log-probs of ``params`` (those
    that sampled it), computed once and held fixed while the rollout is reused."""
    outputs, _, _ = forward(task, module, params, batch, jax.random.PRNGKey(0), deterministic=True)
    return {"old_logps": jax.lax.stop_gradient(task.reference_logps(outputs, batch))}


def score_step(params, batch, *, module, task):
    """Per row of ``batch``: the summed log-probability of its weighted targets, and whether
    each of them is the model's greedy guess (multiple choice, ``train/evaluate.py``)."""
    outputs, _, _ = forward(task, module, params, batch, jax.random.PRNGKey(0), deterministic=True)
    stats = token_stats(outputs, batch["targets"])  # [batch, length] each
    weights = batch["weights"].astype(jnp.float32)
    greedy = (stats.target >= stats.max) | (weights == 0)
    return {"logprob": jnp.sum(stats.logp * weights, axis=-1), "greedy": jnp.all(greedy, axis=-1)}
