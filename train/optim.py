"""The optimizer from a TrainConfig: optax transformation, schedule, clipping, masked decay."""

from __future__ import annotations

import jax
import optax
from flax import linen as nn

from shardzoo.sharding import axes as ax

NO_DECAY_NAMES = ("bias", "scale")  # norms' scales and all biases


def make_schedule(cfg) -> optax.Schedule:
    """Linear warmup from 0 to ``cfg.lr``, then cosine (to lr/10), linear (to 0) or constant."""
    warmup = min(cfg.warmup_steps, cfg.steps)
    rest = max(cfg.steps - warmup, 1)
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, rest, alpha=0.1)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(cfg.lr, 0.0, rest)
    else:
        after = optax.constant_schedule(cfg.lr)
    if not warmup:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), after], [warmup])


def warmup_note(cfg) -> str | None:
    """One line for a run whose warm-up lasts the whole run (``--warmup-steps`` >= ``--steps``,
    e.g. the default 20 on a 20-step try): its learning rate never reaches ``--lr``. The run
    keeps what it was given (a resume must see the same schedule); the line says so and how to
    change it."""
    if not 0 < cfg.steps <= cfg.warmup_steps:
        return None
    return (f"note: --warmup-steps {cfg.warmup_steps} >= --steps {cfg.steps}: the learning rate rises "
            f"linearly the whole run and never reaches --lr {cfg.lr:g} (give --warmup-steps below "
            f"{cfg.steps}, e.g. {cfg.steps // 10})")


def decay_mask(boxed_params):
    """True for kernels and embeddings: >=2 dims besides the scanned ``layers`` axis, not a bias/scale.

    ``boxed_params`` carries logical axis names (``nn.LogicallyPartitioned``, e.g. from
    ``jax.eval_shape(module.init, ...)``); the mask has the unboxed params' structure.
    """

    def mask(path, leaf):
        names = leaf.names if isinstance(leaf, nn.LogicallyPartitioned) else (None,) * leaf.ndim
        own_dims = sum(1 for n in names if n != ax.LAYERS)
        last = getattr(path[-1], "key", str(path[-1]))
        return own_dims >= 2 and last not in NO_DECAY_NAMES

    return jax.tree_util.tree_map_with_path(
        mask, boxed_params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )


def make_optimizer(cfg, boxed_params) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``(tx, schedule)``: clip by global norm, then the named optimizer with masked weight decay."""
    schedule = make_schedule(cfg)
    mask = decay_mask(boxed_params)
    wd = cfg.weight_decay
    if cfg.optimizer == "adamw":
        opt = optax.adamw(schedule, weight_decay=wd, mask=mask)
    elif cfg.optimizer == "lion":
        opt = optax.lion(schedule, weight_decay=wd, mask=mask)
    elif cfg.optimizer == "adafactor":
        opt = optax.adafactor(schedule, weight_decay_rate=wd or None, weight_decay_mask=mask)
    else:  # adam and sgd: L2 decay added to the gradient (adamw is the decoupled one)
        base = optax.adam(schedule) if cfg.optimizer == "adam" else optax.sgd(schedule)
        opt = optax.chain(optax.masked(optax.add_decayed_weights(wd), mask), base) if wd else base
    parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm else []
    return optax.chain(*parts, opt), schedule
