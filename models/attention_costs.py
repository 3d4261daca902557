"""What attention costs, for the plan and the FLOP count (models/costs.py): its parameters, its
FLOPs in training and decoding, the arrays one layer keeps (by logical axes, as ``Cost.t``
counts them), the model-wide mask terms and its decoding cache. The ``Attention`` block is
``models/attention.py``.
"""

from __future__ import annotations

import jax.numpy as jnp

from shardzoo.models.attention_kernels import attention_kernel
from shardzoo.models.layers import fuses
from shardzoo.models.norms import norm_params
from shardzoo.models.splash import padded_width
from shardzoo.sharding import axes as ax

BLHD = (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM)
BLKD = (ax.BATCH, ax.LENGTH, ax.KV_HEADS, ax.HEAD_DIM)
BHL = (ax.BATCH, ax.HEADS, ax.LENGTH, None)  # attention scores: [batch, heads, q, k]


def _latent_params(a) -> int:
    """Multi-head latent attention's projections: q (or q_a, q_b), kv_a, k_rope, kv_b, o."""
    d, h = a.hidden_size, a.num_attention_heads
    q_out = h * a.qk_head_size
    q = d * a.latent.q_lora_rank + a.latent.q_lora_rank * q_out if a.latent.q_lora_rank else d * q_out
    kv = d * (a.latent.kv_lora_rank + a.latent.qk_rope_head_dim) + a.latent.kv_lora_rank * h * (a.latent.qk_nope_head_dim + a.latent.v_head_dim)
    return q + kv + h * a.latent.v_head_dim * d


def params(a) -> tuple[int, int]:
    """(the projections q, k, v, o and the output gate; the qk-norms, biases, sinks and latent norms)."""
    d, hd, vd, nh = a.hidden_size, a.head_size, a.v_head_size, a.num_attention_heads
    matmul = _latent_params(a) if a.latent else d * (hd * (nh + a.kv_heads) + vd * (nh + (1 - a.attention_k_eq_v) * a.kv_heads))
    matmul += d * hd * nh * a.attn_output_gate + d * nh * a.attn_head_gate  # the output gates' projections
    other = 0
    if a.qk_norm not in ("none", "l2"):  # l2: no weight
        other += norm_params(a, hd, not a.qk_norm_no_bias) * (2 if a.qk_norm == "head" else nh + a.kv_heads)
    if a.attention_bias:
        other += hd * (nh * (1 + a.attn_output_gate) + a.kv_heads) + vd * (1 - a.attention_k_eq_v) * a.kv_heads
    if a.attention_out_bias:
        other += d
    if a.attention_sinks:
        other += nh
    other += norm_params(a, nh * hd) * a.sub_norms  # BitNet's attn_sub_norm
    other += 4 * hd * a.diff_attention  # differential attention's lambda_q1, lambda_k1, lambda_q2, lambda_k2
    if a.latent:  # the latents' norms
        other += a.latent.kv_lora_rank + (a.latent.q_lora_rank or 0)
    return matmul, other


def _keys(spec, seq_len: int) -> float:
    """Keys a query of a training row sees on average: half the row, its window, or half its chunk."""
    w, c = spec.window, spec.chunk
    if c and c < seq_len:  # whole chunks of c (the last one possibly cut): about c / 2 keys each
        return c / 2
    return seq_len / 2 if not w or w >= seq_len else w - w * w / (2 * seq_len)


def flops(a, spec, seq_len: int) -> float:
    """q.k and probs.v: 2 x 3 FLOPs (forward and backward) per multiply-add of each."""
    return 6 * a.num_attention_heads * (a.qk_head_size + a.v_head_size) * _keys(spec, seq_len)


def decode_flops(a, spec, context: float) -> float:
    """q.k and probs.v of one token over the ``context`` keys it attends (its window or chunk capping them)."""
    keys = min(context, spec.window or context, spec.chunk or context)
    return 2 * a.num_attention_heads * (a.qk_head_size + a.v_head_size) * keys


def _flash(cost) -> bool:
    """Whether the kernel keeps no scores, probabilities or mask (splash off a ring; cuDNN)."""
    a, e = cost.config.arch, cost.config.execution
    kernel = attention_kernel(cost.config, jnp.dtype(e.dtype), cost.seq_len)  # splash: not under a ring
    # latent attention always runs in plain XLA (its values are narrower than its keys)
    return kernel == "splash" and cost.ring == 1 or kernel == "cudnn" and not a.attn_logit_softcapping and not a.latent


def activations(cost, spec=None) -> dict:
    """One layer's attention arrays (models/costs.py's doc: query ... attn_context)."""
    a, e, t, length = cost.config.arch, cost.config.execution, cost.t, cost.seq_len
    h, k, dh, dq, dv = a.num_attention_heads, a.kv_heads, a.head_size, a.qk_head_size, a.v_head_size
    scores, probs = (0, 0) if _flash(cost) else (t(h * length, BHL), t(h * length, BHL, 4))
    if cost.ring > 1:  # its blocks keep only their float32 numerators, of the visible block pairs
        scores, probs = 0, probs if cost.gathered else int(probs * (cost.ring + 1) / (2 * cost.ring))
    out = {"query": t(h * dq, BLHD), "key": t(k * dq, BLKD), "value": t(k * dv, BLKD),
           "kv_proj": t(k * dh, BLKD) if fuses(e) and not a.latent and dv == dh else 0,  # fused's
           "scores": scores, "probs": probs, "attn_context": t(h * dv, BLHD)}
    if _flash(cost) and attention_kernel(cost.config, jnp.dtype(e.dtype), length) == "splash":
        # the kernel's output (head_dim as it gets it) and float32 log-sum-exp (splash.RESIDUALS)
        out["attn_kernel"] = t(h * padded_width(dv), BLHD) + t(h, BLHD, 4)
    if a.latent:
        lat = a.latent.kv_lora_rank + (a.latent.q_lora_rank or 0)
        out.update(latent=t(lat, (ax.BATCH, ax.LENGTH, ax.KV_LORA)),
                   latent_norm=t(3 * lat, (ax.BATCH, ax.LENGTH, ax.KV_LORA), 4))
    if a.attn_logit_softcapping:
        out["softcap"] = t(2 * h * length, BHL)
    if a.qk_norm in ("head", "heads", "projection"):  # as attn_norm's, of every query and key head
        out["qk_norm"] = t(3 * (h + k) * dq, BLHD, 4)
    return out


def model_terms(cost) -> dict:
    """The mask (bool [batch, K, H/K, L, L], made once outside the layer scan; none with a flash
    kernel or a ring) and, on a ring, the diagonal block's two float32 cotangents."""
    h, t, ring = cost.config.arch.num_attention_heads, cost.t, cost.ring
    out = {"mask": 0 if _flash(cost) or ring > 1 else t(h * cost.seq_len, BHL, 1)}
    if ring > 1 and not cost.gathered:  # (length / ring)^2 each
        out["ring_diagonal"] = 2 * t(h * cost.seq_len, BHL, 4) // ring
    return out


def cache_bytes(a, batch: int, length: int, nbytes: int) -> int:
    """Keys and values (latent attention: the latent and the rotary key), the segment ids of every
    position, and the cache index."""
    per = a.latent.kv_lora_rank + a.latent.qk_rope_head_dim if a.latent else a.kv_heads * (a.head_size + a.v_head_size)
    return batch * length * (per * nbytes + 4) + 4
