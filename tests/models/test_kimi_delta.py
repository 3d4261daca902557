"""Kimi delta attention (models/kimi_delta.py): the chunked training form equals the
token-by-token recurrence (outputs, final state and gradients, 1e-5) for lengths that are and are
not multiples of the chunk, with packed segments and an initial state; both equal transformers'
``chunk_kimi_delta_attention`` and ``recurrent_kimi_delta_attention`` (1e-5); the per-channel decay
matters (a per-head decay gives other outputs). In the model too (kimi-linear-tiny cut to one KDA and
one latent attention layer, a dense MLP and an MoE; logits and gradients, chunks against steps). Context parallelism (context=4): logits and
gradients equal one device's (1e-5), the states pass by collective-permutes and no device gathers
the row in a KDA layer. The plan within 15% of the compiled step; the decoding cache counted. fp32.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen as nn
from transformers.models.kimi_linear import modeling_kimi_linear as hf

from shardzoo.models import delta_rule, get_model
from shardzoo.models import kimi_delta as kd
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.sharding.partition import Placement, activate, logical_shardings
from shardzoo.train.program import count_collectives

sys.path.insert(0, os.path.dirname(__file__))
from mixer_checks import FAST, length_gathers, objective, permutes_of  # noqa: E402

CHUNK, HEADS, D = 4, 3, 8


def raw_inputs(length, seed=0):
    """q, k (not yet normalised), v, g [batch, length, heads, head_dim] (log decays), beta."""
    ks = jax.random.split(jax.random.key(seed), 5)
    q, k, v = (jax.random.normal(ks[i], (2, length, HEADS, D)) for i in range(3))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (2, length, HEADS, D)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (2, length, HEADS)))
    return q, k, v, g, beta


def rule_inputs(length, seed=0):
    q, k, v, g, beta = raw_inputs(length, seed)
    seg = np.ones((2, length), np.int32)
    seg[0, length // 3:] = 2  # row 0: two documents; row 1: left padding (segment 0), then one
    seg[1, :3] = 0
    return (delta_rule.l2norm(q) * D**-0.5, delta_rule.l2norm(k), v, g, beta), jnp.asarray(seg)


@pytest.mark.parametrize("length", [12, 13, 3])
def test_chunked_equals_the_recurrence_with_gradients(length):
    xs, seg = rule_inputs(length)
    state = jax.random.normal(jax.random.key(7), (2, HEADS, D, D))
    prev = jnp.array([1, 5])  # row 0's state belongs to its first segment, row 1's to none of its own

    def loss(fn, *args):
        out, final = fn(*args)
        probe = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return jnp.sum(out * probe) + jnp.sum(jnp.sin(final))

    def both(xs, state):  # one compiled program for every output (op by op it is 3x slower)
        step = jax.grad(lambda xs, s: loss(delta_rule.gated_delta_step, *xs, seg, s, prev), argnums=(0, 1))(xs, state)
        chunked = jax.grad(lambda xs, s: loss(lambda *a: kd.kimi_delta_chunked(*a[:5], CHUNK, *a[5:]),
                                              *xs, seg, s, prev), argnums=(0, 1))(xs, state)
        return (delta_rule.gated_delta_step(*xs, seg, state, prev), kd.kimi_delta_chunked(*xs, CHUNK, seg, state, prev),
                kd.kimi_delta_chunked(*xs, CHUNK)[0], step, chunked)

    (out1, s1), (out2, s2), unsegmented, step, chunked = jax.jit(both, compiler_options=FAST)(xs, state)
    np.testing.assert_allclose(out2, out1, atol=1e-5, rtol=0)
    np.testing.assert_allclose(s2, s1, atol=1e-5, rtol=0)
    assert np.abs(unsegmented - out2).max() > 1e-2  # the segments matter
    for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(step), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_rule_equals_transformers_chunked_and_recurrent():
    """20 tokens from a random initial state: transformers' chunks of 16 and its recurrence (q, k
    normalised in the kernel) against shardzoo's chunks of 4 and its step (1e-5)."""
    q, k, v, g, beta = raw_inputs(20, seed=3)
    state = jax.random.normal(jax.random.key(8), (2, HEADS, D, D))
    t = [torch.tensor(np.asarray(x)) for x in (q, k, v, g, beta, state)]
    ref_chunk, ref_state = hf.chunk_kimi_delta_attention(*t[:3], g=t[3], beta=t[4], chunk_size=16,
                                                         initial_state=t[5], output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True)
    ref_step, _ = hf.recurrent_kimi_delta_attention(*t[:3], g=t[3], beta=t[4], initial_state=t[5],
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    xs = (delta_rule.l2norm(q) * D**-0.5, delta_rule.l2norm(k), v, g, beta)
    out, final = kd.kimi_delta_chunked(*xs, CHUNK, None, state)
    step, _ = delta_rule.gated_delta_step(*xs, None, state)
    np.testing.assert_allclose(out, ref_chunk.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(final, ref_state.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(step, ref_step.numpy(), atol=1e-5, rtol=0)
    per_head = jnp.broadcast_to(g.mean(-1, keepdims=True), g.shape)  # one decay per head: Gated DeltaNet's
    assert np.abs(kd.kimi_delta_chunked(*xs[:3], per_head, beta, CHUNK, None, state)[0] - out).max() > 1e-2


BATCH, LENGTH = 4, 48  # 48 tokens over context=4: 8 ring chunks of 6, each 2 rule chunks (4 and 2)


def packed_batch(seed=0) -> dict:
    rng = np.random.default_rng(seed)
    seg = np.sort(rng.integers(1, 4, (BATCH, LENGTH)), axis=1).astype(np.int32)
    starts = np.concatenate([np.ones((BATCH, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    idx = np.broadcast_to(np.arange(LENGTH), (BATCH, LENGTH))
    positions = (idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1)).astype(np.int32)
    return {"inputs": rng.integers(0, 128, (BATCH, LENGTH)).astype(np.int32), "positions": positions,
            "segment_ids": seg}


@pytest.fixture(scope="module")
def reference():
    """kimi-linear-tiny in chunks of 4, cut to its first KDA layer (dense MLP) and its latent
    attention layer (MoE; dropless: no token order decides a drop), its KDA weights 0.3 x normal
    (the decay's projections 0.05, A = 0.1: a state that lasts) so that they move the logits;
    logits and gradients on one device."""
    module, _ = get_model("kimi-linear-tiny", vocab_size=128, linear_attention_chunk=CHUNK, moe_dispatch="dropless",
                          num_hidden_layers=2, layer_types=(kd.KIMI, "full_attention"), rope_layers=(False, False),
                          mlp_layer_types=("dense", "moe"))
    batch = packed_batch()
    boxed = jax.eval_shape(module.init, jax.random.key(0), batch["inputs"])["params"]
    params = jax.device_get(nn.unbox(jax.jit(module.init)(jax.random.key(0), batch["inputs"])["params"]))
    rng = np.random.default_rng(1)

    def drawn(path, x):
        name = jax.tree_util.keystr(path)
        if "linear_attn" not in name:
            return x
        if name.endswith("['A_log']"):
            return np.full(x.shape, np.log(0.1), np.float32)
        scale = 0.05 if "['f_" in name else 0.3
        return (scale * rng.normal(size=x.shape)).astype(np.float32) if x.ndim >= 2 else x

    params = jax.tree_util.tree_map_with_path(drawn, params)
    (_, logits), grads = objective(module)(params, batch)
    return module, boxed, params, batch, jax.device_get((logits, grads))


def test_the_model_in_chunks_equals_the_model_step_by_step(reference, monkeypatch):
    module, _, params, batch, (logits, grads) = reference
    monkeypatch.setattr(kd, "kimi_delta_chunked", lambda q, k, v, g, beta, chunk, seg=None, state=None,
                        prev_seg=None: delta_rule.gated_delta_step(q, k, v, g, beta, seg, state, prev_seg))
    (_, step_logits), step_grads = objective(module)(params, batch)
    np.testing.assert_allclose(step_logits, logits, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(step_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    off = jax.tree_util.tree_map_with_path(
        lambda p, x: 0 * x if jax.tree_util.keystr(p).endswith("['linear_attn']['out']['kernel']") else x, params)
    (_, without), _ = objective(module)(off, batch)
    assert np.abs(without - logits).max() > 1e-2  # the KDA layers matter to the logits


def test_kda_under_context_parallelism_equals_one_device(reference):
    module, boxed, params, batch, (logits, grads) = reference
    mesh, rules = make_mesh("context=4,data=2"), get_rules("cp")
    f = objective(module.clone(placement=Placement(mesh, rules)))
    with activate(mesh):
        params = jax.device_put(params, logical_shardings(boxed, mesh, rules))
        compiled = f.lower(params, batch).compile()
    (_, cp_logits), cp_grads = compiled(params, batch)
    np.testing.assert_allclose(cp_logits, logits, rtol=0, atol=1e-5)
    flat = jax.tree_util.tree_flatten_with_path(cp_grads)[0]
    for path, a in flat:
        b = grads
        for key in path:
            b = b[key.key]
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    hlo = compiled.as_text()
    permutes = permutes_of(hlo, rf"f32\[{BATCH // 2},4,16,16\]")  # [batch, heads, key_dim, value_dim] states
    assert permutes >= 6, count_collectives(hlo)  # 2 x 3 hops of the state forward (and back for gradients)
    assert "/linear_attn/" in hlo and not length_gathers(hlo, LENGTH, "/linear_attn/")
    print(f"cp: {permutes} state collective-permutes, max |logit diff| {np.abs(cp_logits - logits).max():.1e}")


def test_the_decoding_cache_of_a_kda_layer_is_counted():
    """``costs.decode_cache_bytes`` equals the bytes of the cache the Program makes (kimi-linear-tiny:
    3 KDA layers' states and convolution inputs, 1 latent attention layer's latents)."""
    from shardzoo.models import get_config
    from shardzoo.models.costs import decode_cache_bytes
    from shardzoo.train.program import Program

    config = get_config("kimi-linear-tiny")
    shapes, _ = Program(config, get_rules("fsdp"), make_mesh("fsdp=8")).decoding.cache_shardings(8, 32)
    per_layer = {name: sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))
                 for name, tree in shapes.items()}
    counted = decode_cache_bytes(config.arch, 8, 32, 4)
    assert counted[kd.KIMI] == sum(per_layer[f"layers_{i}"] for i in range(3))
    assert counted["attention"] == per_layer["layers_3"]


def test_plan_counts_the_kda_layers_within_15_percent_of_the_compiled_step():
    """kimi-linear-tiny, 16 x 64 under fsdp=8: the plan's total and temporaries against XLA's."""
    from shardzoo.models import get_config
    from shardzoo.train.config import TrainConfig
    from shardzoo.train.tasks.registry import run_program

    config = get_config("kimi-linear-tiny")
    program = run_program(TrainConfig(batch_size=16, seq_len=64), config, get_rules("fsdp"), make_mesh("fsdp=8"))
    totals, memory = program.plan().totals, program.compile_report()["memory"]
    print(f"plan / compiled: total {totals['total'] / memory['total']:.2f}, temp "
          f"{(totals['activations'] + totals['gradients']) / memory['temp']:.2f}")
    assert 0.85 < totals["total"] / memory["total"] < 1.15, (totals, memory)
    temp = totals["activations"] + totals["gradients"]
    assert 0.85 < temp / memory["temp"] < 1.15, (temp, memory)
