"""KTO (``--task kto``): unpaired rows, each a prompt and completion labelled desirable or not,
with its mismatched pair's log-ratio as the KL estimate (TRL's ``KTOTrainer``); the batch is
``data/preference.py``'s unpaired layout, the model call and reference as DPO's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from shardzoo.errors import UserError
from shardzoo.sharding import axes as ax
from shardzoo.train.tasks.base import Field
from shardzoo.train.tasks.preference import DPORun, PreferenceTask, sequence_logps
from shardzoo.train.tasks.settings import KTO_LOSSES

KTO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")


@dataclasses.dataclass(frozen=True)
class KTOTask(PreferenceTask):
    """KTO on unpaired rows (TRL's KTOTrainer): each row's two sequences are its prompt with its
    own completion and with the mismatched (KL) completion (``data/preference.py``'s ``kl_pairs``),
    ``labels [batch]`` 1 for a desirable completion. With ``r`` the completion's log-ratio and
    ``z = max(0, mean over the batch of the KL sequences' log-ratios)`` (no gradient), ``kto``:
    ``desirable_weight (1 - sig(beta (r - z)))`` or ``undesirable_weight (1 - sig(beta (z - r)))``;
    ``apo_zero_unpaired``: ``1 - sig(beta r)`` or ``sig(beta r)``; averaged over the rows. Metrics
    as TRL's: ``kl``, and ``rewards/*``, ``logps/*`` averaged over the desirable (chosen) or
    undesirable (rejected) rows (0 where the batch has none)."""

    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def fields(self, config, batch_size: int, seq_len: int | None) -> dict[str, Field]:
        return {**super().fields(config, batch_size, seq_len),
                "labels": Field((batch_size,), "float32", (ax.BATCH,))}

    def sums(self, outputs, batch, totals=None) -> dict:
        w = batch["weights"].astype(jnp.float32)
        good = batch["labels"].astype(jnp.float32) * w
        bad = w - good
        logps, _ = sequence_logps(outputs, batch)  # [batch, 2]: the completion, the KL sequence
        ratios = logps - batch["ref_logps"].astype(jnp.float32)
        r = ratios[:, 0]
        if self.loss == "kto":
            kl = jnp.sum(ratios[:, 1] * w) / jnp.maximum(jnp.sum(w), 1e-8)
            kl = jax.lax.stop_gradient(jnp.maximum(kl, 0.0))
            chosen, rejected = 1.0 - jax.nn.sigmoid(self.beta * (r - kl)), 1.0 - jax.nn.sigmoid(self.beta * (kl - r))
        else:  # apo_zero_unpaired
            kl = jnp.zeros(())
            chosen, rejected = 1.0 - jax.nn.sigmoid(self.beta * r), jax.nn.sigmoid(self.beta * r)
        rewards = self.beta * r
        return {
            "loss": jnp.sum(self.desirable_weight * chosen * good + self.undesirable_weight * rejected * bad),
            "weight": jnp.sum(w), "chosen": jnp.sum(good), "rejected": jnp.sum(bad), "kl": kl * jnp.sum(w),
            "rewards/chosen": jnp.sum(rewards * good), "rewards/rejected": jnp.sum(rewards * bad),
            "logps/chosen": jnp.sum(logps[:, 0] * good), "logps/rejected": jnp.sum(logps[:, 0] * bad),
            "pairs_truncated": jnp.sum(batch["truncated"].astype(jnp.float32) * w),
        }

    def extra_metrics(self, sums, total_weight) -> dict:
        """TRL's: each side's means over its rows, the margin of those means, the batch's ``kl``."""
        out = {"kl": sums["kl"] / total_weight, "pairs_truncated": sums["pairs_truncated"]}
        for side in ("chosen", "rejected"):
            n = sums[side]
            for kind in ("rewards", "logps"):
                out[f"{kind}/{side}"] = jnp.where(n > 0, sums[f"{kind}/{side}"] / jnp.maximum(n, 1e-8), 0.0)
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out


def kto_task(loss: str = "kto", beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> KTOTask:
    """The ``kto`` task (TRL's KTOConfig names); bad settings are one-line UserErrors."""
    if loss not in KTO_LOSSES:
        raise UserError(f"--loss {loss!r}: --task kto takes one of {', '.join(KTO_LOSSES)}")
    if not beta > 0:
        raise UserError(f"--beta must be > 0, got {beta}")
    for name, value in (("desirable-weight", desirable_weight), ("undesirable-weight", undesirable_weight)):
        if not value >= 0:
            raise UserError(f"--{name} must be 0 or more, got {value}")
    return KTOTask("kto", "examples", f"{loss}_loss", has_accuracy=False, has_perplexity=False,
                   signals=("rewards/margins", "kl"), loss=loss,
                   beta=float(beta), desirable_weight=float(desirable_weight),
                   undesirable_weight=float(undesirable_weight))


class KTORun(DPORun):
    """``--task kto``: unpaired rows, each with its mismatched pair; the reference as DPO's."""

    name = eval_task = "kto"
    unpaired = True
    trained_on, eval_rows = "unpaired (KTO) rows", "examples"
    recorded = ("loss", "beta", "desirable_weight", "undesirable_weight")

    def make(self, cfg, beta: float):
        return kto_task(cfg.loss or "kto", beta, cfg.desirable_weight, cfg.undesirable_weight)

    def default(self):
        return kto_task()

    def from_settings(self, **settings):
        return kto_task(**settings)

    def format_eval(self, metrics: dict) -> str:
        return (f"kto ({metrics['loss_type']}, beta {metrics['beta']:g}, reference: {metrics['reference']}) over "
                f"{metrics['examples']} examples: loss {metrics['loss']:.4f}, kl {metrics['kl']:.4f}, rewards/margins "
                f"{metrics['rewards/margins']:.4f}, logps/chosen {metrics['logps/chosen']:.4f}, logps/rejected "
                f"{metrics['logps/rejected']:.4f}")
