"""What a model costs: the activation memory a training step keeps per device.

Each config's ``activation_estimate(batch_size, seq_len, shards)`` calls one of these with a
``shards(logical_names) -> int`` from the plan (how many devices split an array with those
names under the rules), so the plan reads no model field. It counts the activations autodiff
saves for the backward pass, each divided by how many devices share it.

Transformer (a config with ``num_hidden_layers``), bytes per device::

    layers * saved(policy) + (policy != "none") * saved("none") + head

where ``saved(p)`` sums, over the terms below that policy ``p`` keeps, ``batch * seq_len *
elements_per_token * dtype_bytes / shards(names)``. Per token and layer (D hidden, F
intermediate, H heads, K kv heads, Dh head dim, L seq_len):

    block_input D (batch,length,embed)  kept by every policy (the scan carry)
    attn_norm D, query H*Dh, key K*Dh, value K*Dh, scores H*L and probs H*L (batch,heads,
    length,-) [XLA attention; 0 with attention_impl="cudnn"], attn_context H*Dh, attn_out D,
    mlp_norm D, mlp_gate F [gated], mlp_up F, mlp_act F [gated], mlp_hidden F (the input
    of the down projection), mlp_out D; router_logits E in float32 [MoE layers]

    none: all; full: block_input; dots_saveable: block_input, query, key, value, scores,
    attn_context, attn_out, mlp_gate, mlp_up, mlp_out, router_logits;
    dots_with_no_batch_dims_saveable: the same without scores and attn_context;
    save_attn_mlp: block_input, attn_context, mlp_hidden.

With remat (policy != "none") one layer is recomputed whole during the backward pass, hence
the second term. MoE layers replace the MLP terms by ``experts_per_tok * capacity_factor``
times them; dispatch masks are not counted. ``head`` is the final norm D plus logits V in
the compute dtype and again in float32 for the log-softmax.

MLP (a config with ``depth`` and ``width``): the sum of input [batch, embed], each hidden
layer's pre- and post-activation [batch, width] (plus a dropout mask when dropout_rate > 0)
and the head's logits in the compute dtype and in float32, each divided by its shards.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from shardzoo.sharding import axes as ax

BLE = (ax.BATCH, ax.LENGTH, ax.EMBED)
BLHD = (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM)
BLKD = (ax.BATCH, ax.LENGTH, ax.KV_HEADS, ax.HEAD_DIM)
BLF = (ax.BATCH, ax.LENGTH, ax.MLP)
BHL = (ax.BATCH, ax.HEADS, ax.LENGTH, None)  # attention scores: [batch, heads, q, k]

POLICY_TERMS = {
    "full": ("block_input",),
    "dots_saveable": (
        "block_input", "query", "key", "value", "scores", "attn_context", "attn_out",
        "mlp_gate", "mlp_up", "mlp_out", "router_logits",
    ),
    "dots_with_no_batch_dims_saveable": (
        "block_input", "query", "key", "value", "attn_out", "mlp_gate", "mlp_up", "mlp_out",
        "router_logits",
    ),
    "save_attn_mlp": ("block_input", "attn_context", "mlp_hidden"),
}


@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
    bytes: int  # per device
    policy: str
    formula: str
    terms: dict  # name -> bytes per device (per layer for a Transformer's layer terms)


def _term(tokens, per_token, names, nbytes, shards) -> int:
    return int(tokens * per_token * nbytes) // shards(names)


def transformer_activations(cfg, batch_size, seq_len, shards) -> ActivationEstimate:
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    k = cfg.num_key_value_heads or h
    dh = cfg.head_dim or d // h
    nb = jnp.dtype(cfg.dtype).itemsize
    tok = batch_size * seq_len
    gated = cfg.mlp_type == "gated"
    flash = cfg.attention_impl == "cudnn"

    def t(per_token, names, nbytes=nb):
        return _term(tok, per_token, names, nbytes, shards)

    layer = {
        "block_input": t(d, BLE), "attn_norm": t(d, BLE),
        "query": t(h * dh, BLHD), "key": t(k * dh, BLKD), "value": t(k * dh, BLKD),
        "scores": 0 if flash else t(h * seq_len, BHL), "probs": 0 if flash else t(h * seq_len, BHL),
        "attn_context": t(h * dh, BLHD), "attn_out": t(d, BLE), "mlp_norm": t(d, BLE),
        "mlp_gate": t(f, BLF) if gated else 0, "mlp_up": t(f, BLF),
        "mlp_act": t(f, BLF) if gated else 0, "mlp_hidden": t(f, BLF), "mlp_out": t(d, BLE),
    }
    mlp_terms = ("mlp_gate", "mlp_up", "mlp_act", "mlp_hidden")
    experts = cfg.num_local_experts
    moe_layer = dict(layer)
    if experts:
        scale = cfg.num_experts_per_tok * cfg.capacity_factor
        moe_layer.update({n: int(layer[n] * scale) for n in mlp_terms})
        moe_layer["router_logits"] = t(experts, (ax.BATCH, ax.LENGTH, ax.EXPERT), 4)
    freq = cfg.moe_layer_freq
    n_moe = sum((i + 1) % freq == 0 for i in range(cfg.num_hidden_layers)) if experts else 0
    n_dense = cfg.num_hidden_layers - n_moe
    policy = cfg.remat_policy

    def saved(terms, pol):
        keep = POLICY_TERMS.get(pol)
        return sum(v for n, v in terms.items() if keep is None or n in keep)

    total = n_dense * saved(layer, policy) + n_moe * saved(moe_layer, policy)
    if policy != "none":
        total += saved(moe_layer if n_moe else layer, "none")
    head = t(d, BLE) + t(cfg.vocab_size, (ax.BATCH, ax.LENGTH, ax.VOCAB), nb + 4)
    formula = (
        f"{n_dense} dense + {n_moe} MoE layers x saved({policy})"
        + (" + one layer recomputed" if policy != "none" else "")
        + " + final norm and logits"
    )
    return ActivationEstimate(int(total + head), policy, formula, {**layer, "head": head})


def mlp_activations(cfg, batch_size, shards) -> ActivationEstimate:
    nb = jnp.dtype(cfg.dtype).itemsize
    terms = {"input": _term(batch_size, cfg.in_features, (ax.BATCH, ax.EMBED), nb, shards)}
    per_hidden = 3 if cfg.dropout_rate > 0 else 2
    for i in range(cfg.depth):
        names = (ax.BATCH, ax.MLP if i % 2 == 0 else ax.EMBED)
        terms[f"layers_{i}"] = _term(batch_size, cfg.width * per_hidden, names, nb, shards)
    terms["head"] = _term(batch_size, cfg.num_outputs, (ax.BATCH, ax.VOCAB), nb + 4, shards)
    formula = "input + depth x (pre- and post-activation) + logits"
    return ActivationEstimate(sum(terms.values()), "none", formula, terms)
