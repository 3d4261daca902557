"""The router of a MoE layer: which ``num_experts_per_tok`` experts each token goes to, with
what weights (``choose_experts``, by ``router_kind``: ``models/moe_arch.py`` ROUTERS), and the
router's load-balancing and z losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_k(probs, k: int):
    """``jax.lax.top_k`` over the last axis as k argmaxes (ties go to the lower index, as there).

    XLA's TopK all-gathers a batch-sharded input (seen on CPU: the whole batch's router
    probabilities on every device); argmax partitions along batch like any reduction.
    """
    num_experts, masked, idx = probs.shape[-1], probs, []
    for _ in range(k):
        idx.append(jnp.argmax(masked, axis=-1))
        masked = jnp.where(jax.nn.one_hot(idx[-1], num_experts, dtype=bool), -jnp.inf, masked)
    idx = jnp.stack(idx, axis=-1)
    return jnp.take_along_axis(probs, idx, axis=-1), idx


def _group_mask(scores, n_group: int, topk_group: int, group_score):
    """Bool [..., expert]: the experts of the ``topk_group`` groups (of ``n_group`` equal runs of
    experts) that ``group_score`` [..., group, experts_per_group] -> [..., group] ranks best."""
    *lead, num_experts = scores.shape
    grouped = scores.reshape(*lead, n_group, num_experts // n_group)
    _, best = top_k(group_score(grouped), topk_group)  # [..., topk_group]
    chosen = jax.nn.one_hot(best, n_group, dtype=bool).any(-2)  # [..., group]
    return jnp.repeat(chosen, num_experts // n_group, axis=-1)


def _sparsemixer(logits, eps: float):
    """(weights, experts) [..., 2] of SparseMixer's routing as transformers' ``sparsemixer`` at
    eval: the best expert, weighted by its share of a softmax over the logits s with
    (max - s) / max(|s|, max) <= 2 eps; then the best of the others, weighted likewise among the
    others. Training takes the same choice (transformers samples it, with Heun's gradient
    estimate); the gradient reaches the logits through the two softmaxes."""
    num_experts, rest = logits.shape[-1], logits
    weights, idx = [], []
    for _ in range(2):
        best = jnp.argmax(rest, axis=-1)[..., None]  # [..., 1]
        top = jnp.take_along_axis(rest, best, axis=-1)
        far = jax.lax.stop_gradient((top - logits) / jnp.maximum(jnp.abs(logits), top) > 2 * eps)
        gates = jax.nn.softmax(jnp.where(far, -jnp.inf, rest), axis=-1)
        weights.append(jnp.take_along_axis(gates, best, axis=-1))
        idx.append(best)
        rest = jnp.where(jax.nn.one_hot(best[..., 0], num_experts, dtype=bool), -jnp.inf, rest)
    return jnp.concatenate(weights, axis=-1), jnp.concatenate(idx, axis=-1)


def choose_experts(logits, cfg, bias=None):
    """(probs, top_p, top_idx) of router ``logits`` [..., expert] by ``cfg.router_kind``:

    - ``softmax``: the k most probable experts of the softmax (Mixtral, DeepSeek-V2 greedy);
    - ``softmax_groups``: the same within the ``topk_group`` groups whose best probability is
      highest (DeepSeek-V2's group_limited_greedy; the other groups' probabilities count as 0);
    - ``sigmoid_groups``: sigmoid scores; the choice adds the correction ``bias`` [expert]
      (DeepSeek-V3's e_score_correction_bias), ranks groups by the sum of their two best and
      picks the k best within the ``topk_group`` best groups; the weights are the unbiased scores.
    - ``sigmoid_input``: the k largest logits, weights their sigmoid (Llama 4); ``MoeMLP``
      scales each chosen expert's input by its weight, not its output.
    - ``softmax_bias``: the k experts whose softmax probability plus the correction ``bias``
      [expert] is highest; the weights are their unbiased probabilities (Ernie 4.5 MoE's
      moe_statics.e_score_correction_bias).
    - ``sparsemixer``: Phi-MoE's top-2 (``_sparsemixer``), as transformers computes it at eval.
    - ``sigmoid``: the k best sigmoid scores, weighted by them (Flint).
    - ``logit_bias``: the k experts whose logit plus the correction ``bias`` [expert] is highest;
      the weights are the sigmoid of their logits (Kolibri's expert_bias).

    ``norm_topk_prob`` renormalises the k weights, then ``routed_scaling_factor`` scales them.
    ``probs`` is what the load-balancing loss takes (the softmax, or the normalised scores).
    """
    k, kind = cfg.num_experts_per_tok, cfg.router_kind
    if kind == "sigmoid_input":
        top_logits, top_idx = top_k(logits, k)
        top_p = jax.nn.sigmoid(top_logits)
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdims=True)
        eps = 1e-20
    elif kind == "sigmoid_groups":
        scores = jax.nn.sigmoid(logits)
        choice = scores + bias
        keep = _group_mask(choice, cfg.n_group, cfg.topk_group, lambda g: top_k(g, 2)[0].sum(-1))
        _, top_idx = top_k(jnp.where(keep, choice, -jnp.inf), k)
        top_p = jnp.take_along_axis(scores, top_idx, axis=-1)
        probs = scores / scores.sum(-1, keepdims=True)
        eps = 1e-20  # transformers' denominator guard
    elif kind == "sparsemixer":
        probs = jax.nn.softmax(logits, axis=-1)
        top_p, top_idx = _sparsemixer(logits, cfg.sparsemixer_eps)
    elif kind == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        top_p, top_idx = top_k(scores, k)
        probs = scores / scores.sum(-1, keepdims=True)
        eps = 0.0
    elif kind == "logit_bias":
        _, top_idx = top_k(logits + bias, k)
        top_p = jax.nn.sigmoid(jnp.take_along_axis(logits, top_idx, axis=-1))
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdims=True)
        eps = 0.0  # transformers divides by the bare sum
    elif kind == "softmax_bias":
        probs = jax.nn.softmax(logits, axis=-1)
        _, top_idx = top_k(probs + bias, k)
        top_p = jnp.take_along_axis(probs, top_idx, axis=-1)
        eps = 0.0
    else:
        probs = jax.nn.softmax(logits, axis=-1)
        masked = probs
        if kind == "softmax_groups":
            masked = jnp.where(_group_mask(probs, cfg.n_group, cfg.topk_group, lambda g: g.max(-1)), probs, 0.0)
        top_p, top_idx = top_k(masked, k)  # [..., k]
        eps = 0.0
    if cfg.norm_topk_prob:
        top_p = top_p / (top_p.sum(-1, keepdims=True) + eps)
    if cfg.routed_scaling_factor != 1.0:
        top_p = top_p * cfg.routed_scaling_factor
    return probs, top_p, top_idx


def split_zero_experts(top_idx, top_p, num_experts: int):
    """(top_idx, top_p, identity, zero) of choices over ``num_experts`` routed experts and the
    zero-computation ones after them (LongCat-Flash's identity experts, indices >= num_experts):
    ``identity`` [..., 1] the weights of a token's zero experts summed (its input times it is
    their output); each such choice (``zero`` [..., k]) weighted 0 and sent to index
    ``num_experts``, which every dispatch leaves out as it does padding: it takes no slot, so
    the routed choices fill the capacity alone (transformers instead spreads them over the
    routed experts at weight 0, for its communication's sake: the same numbers)."""
    zero = top_idx >= num_experts
    identity = jnp.where(zero, top_p, 0.0).sum(-1, keepdims=True)
    return jnp.where(zero, num_experts, top_idx), jnp.where(zero, 0.0, top_p), identity, zero


def router_losses(logits, probs, top_idx, token_mask=None):
    """(load_balance, z_loss) of router ``logits`` [..., expert] and its top-k choices.

    load_balance = num_experts * sum_e f_e * P_e as HF Mixtral's ``load_balancing_loss_func``:
    f_e = top-k assignments to e per token (summed over the k choices, so it equals k at
    perfect balance), P_e = mean router probability of e. z_loss = mean logsumexp(logits)^2.
    Means are over the tokens where ``token_mask`` [...] is true (all without one), as HF's
    with an attention mask: padding does not count.
    """
    num_experts = logits.shape[-1]
    w = jnp.ones(logits.shape[:-1], jnp.float32) if token_mask is None else token_mask.astype(jnp.float32)
    w = w.reshape(-1) / jnp.maximum(w.sum(), 1.0)  # [tokens], sums to 1
    f = jax.nn.one_hot(top_idx, num_experts, dtype=jnp.float32).sum(-2)  # [..., expert]
    f = w @ f.reshape(-1, num_experts)  # [expert]
    p = w @ probs.reshape(-1, num_experts)  # [expert]
    z = jax.nn.logsumexp(logits, axis=-1).reshape(-1)
    return num_experts * jnp.sum(f * p), jnp.sum(w * z**2)

