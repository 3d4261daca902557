"""Pure train and eval steps; the Trainer jits them with shardings and donation.

The loss is token cross-entropy weighted by ``batch["weights"]`` (sum of weighted losses over
the sum of weights) plus the sum of every leaf of the model's ``"losses"`` collection (MoE
auxiliary losses, already weighted). Gradient accumulation scans over K microbatches; each
microbatch contributes ``weighted_loss_sum / total_weight + aux / K`` with the total weight of
the whole batch, so K microbatches give the gradient of one step on the whole batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "weights")


def forward(module, params, batch, rng, deterministic: bool):
    """``(logits, aux_loss or None, model_metrics)``: one model call per the zoo's contract."""
    logits, collections = module.apply(
        {"params": params},
        batch["inputs"],
        positions=batch["positions"],
        segment_ids=batch["segment_ids"],
        deterministic=deterministic,
        rngs={"dropout": rng},
        mutable=["losses", "metrics"],
    )  # logits: [batch, length, vocab]
    losses = jax.tree.leaves(collections.get("losses", {}))
    aux = sum(jnp.sum(x.astype(jnp.float32)) for x in losses) if losses else None
    model_metrics = {}  # each sown metric's name -> its mean over layers and calls
    for path, leaf in jax.tree_util.tree_flatten_with_path(collections.get("metrics", {}))[0]:
        name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
        model_metrics.setdefault(name, []).append(jnp.ravel(leaf.astype(jnp.float32)))
    model_metrics = {k: jnp.mean(jnp.concatenate(v)) for k, v in model_metrics.items()}
    return logits, aux, model_metrics


def token_sums(logits, targets, weights):
    """Sums over tokens of weighted cross-entropy, of weights and of weighted correct guesses."""
    logits = logits.astype(jnp.float32)  # [batch, length, vocab]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [batch, length]
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return jnp.sum(losses * weights), jnp.sum(weights), jnp.sum(correct * weights)


def split_microbatches(batch, k: int):
    """``[batch, length]`` leaves to ``[k, batch/k, length]``; microbatch j holds rows j, j+k, ...

    Strided rows keep every device's share of each microbatch local when ``batch`` is sharded.
    """
    def split(x):
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, batch)


def train_step(state, batch, rng, nan_at_step=-1, *, module, tx, schedule, grad_accum=1,
               skip_nonfinite=False):
    """One optimizer step on ``batch`` (leading ``[batch, length]``): ``(new_state, metrics)``.

    ``rng`` is the run's base key; dropout draws from ``fold_in(rng, step)``. With
    ``skip_nonfinite`` a step whose loss or gradient norm is not finite keeps the old params
    and optimizer state (the step counter still advances). ``nan_at_step`` (a test aid, an
    int32 argument so that every run shares one program) makes the loss and gradient of that
    step NaN; -1: never.
    """
    step = state.step + 1  # the number of this step, 1-based
    step_rng = jax.random.fold_in(rng, state.step)
    total_weight = jnp.maximum(jnp.sum(batch["weights"].astype(jnp.float32)), 1e-8)
    poison = jnp.where(step == nan_at_step, jnp.nan, 1.0)  # exactly 1.0 but at nan_at_step

    def objective(params, mb, mb_rng):
        logits, aux, model_metrics = forward(module, params, mb, mb_rng, deterministic=False)
        loss_sum, weight_sum, correct = token_sums(logits, mb["targets"], mb["weights"])
        obj = loss_sum / total_weight + (0.0 if aux is None else aux / grad_accum)
        obj = obj * poison
        return obj, (loss_sum, correct, aux, model_metrics)

    grad_fn = jax.value_and_grad(objective, has_aux=True)
    if grad_accum == 1:
        (loss, (loss_sum, correct, aux, model_metrics)), grads = grad_fn(state.params, batch, step_rng)
    else:
        def body(grads_acc, xs):
            mb, i = xs
            out, grads = grad_fn(state.params, mb, jax.random.fold_in(step_rng, i))
            return jax.tree.map(jnp.add, grads_acc, grads), out

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        micro = (split_microbatches(batch, grad_accum), jnp.arange(grad_accum))
        grads, (objs, (loss_sums, corrects, auxes, metrics_k)) = jax.lax.scan(body, zeros, micro)
        loss, loss_sum, correct = jnp.sum(objs), jnp.sum(loss_sums), jnp.sum(corrects)
        aux = None if auxes is None else jnp.mean(auxes)
        model_metrics = jax.tree.map(jnp.mean, metrics_k)

    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_state = state.replace(step=step, params=params, opt_state=opt_state)
    if skip_nonfinite:
        keep = lambda new, old: jnp.where(finite, new, old)
        new_state = new_state.replace(
            params=jax.tree.map(keep, params, state.params),
            opt_state=jax.tree.map(keep, opt_state, state.opt_state),
        )
    metrics = {
        "loss": loss,
        "ce_loss": loss_sum / total_weight,
        "accuracy": correct / total_weight,
        "tokens": total_weight,
        "grad_norm": grad_norm,
        "learning_rate": schedule(state.step),
        "finite": finite,
    }
    if aux is not None:
        metrics["aux_loss"] = aux
    metrics.update(model_metrics)
    return new_state, metrics


def eval_step(params, batch, *, module):
    """Sums over the batch's tokens: weighted cross-entropy, weights, weighted correct guesses."""
    logits, _, _ = forward(module, params, batch, jax.random.PRNGKey(0), deterministic=True)
    loss_sum, weight_sum, correct = token_sums(logits, batch["targets"], batch["weights"])
    return {"loss_sum": loss_sum, "weight_sum": weight_sum, "correct_sum": correct}


def summarize_eval(totals: dict) -> dict:
    """Eval loss, perplexity and token accuracy from summed eval_step outputs."""
    weight = max(float(totals["weight_sum"]), 1e-8)
    loss = float(totals["loss_sum"]) / weight
    return {"eval_loss": loss, "eval_perplexity": float(jnp.exp(jnp.minimum(loss, 80.0))),
            "eval_accuracy": float(totals["correct_sum"]) / weight}
