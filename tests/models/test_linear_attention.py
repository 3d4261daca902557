"""The gated delta rule (models/delta_rule.py): the chunked training form equals the
token-by-token recurrence (outputs, final state and gradients, 1e-5) for lengths that are and
are not multiples of the chunk, with packed segments and an initial state; in the model too
(qwen3-next-tiny cut to one linear-attention and one attention layer, logits and gradients). Context parallelism (context=4): logits and
gradients equal one device's (1e-5), the states pass by collective-permutes and no device gathers
the row in a linear-attention layer. fp32.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from shardzoo.models import delta_rule, get_model, linear_attention
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.sharding.partition import Placement, activate, logical_shardings
from shardzoo.train.jit import count_collectives

sys.path.insert(0, os.path.dirname(__file__))
from mixer_checks import FAST, length_gathers, objective, permutes_of  # noqa: E402

BATCH, LENGTH, CHUNK = 4, 48, 4  # 48 tokens over context=4: 8 ring chunks of 6, each 2 rule chunks of 4
HEADS, DK, DV = 4, 8, 12


def rule_inputs(length, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = delta_rule.l2norm(jax.random.normal(ks[0], (2, length, HEADS, DK))) * DK**-0.5
    k = delta_rule.l2norm(jax.random.normal(ks[1], (2, length, HEADS, DK)))
    v = jax.random.normal(ks[2], (2, length, HEADS, DV))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (2, length, HEADS)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (2, length, HEADS)))
    seg = np.ones((2, length), np.int32)
    seg[0, length // 3:] = 2  # row 0: two documents; row 1: left padding (segment 0), then one
    seg[1, :3] = 0
    return (q, k, v, g, beta), jnp.asarray(seg)


@pytest.mark.parametrize("length", [12, 13, 3])
def test_chunked_equals_the_recurrence_with_gradients(length):
    xs, seg = rule_inputs(length)
    state = jax.random.normal(jax.random.key(7), (2, HEADS, DK, DV))
    prev = jnp.array([1, 5])  # row 0's state belongs to its first segment, row 1's to none of its own

    def loss(fn, *args):
        out, final = fn(*args)
        probe = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return jnp.sum(out * probe) + jnp.sum(jnp.sin(final))

    def both(xs, state):  # one compiled program for every output (op by op it is 3x slower)
        step = jax.grad(lambda xs, s: loss(delta_rule.gated_delta_step, *xs, seg, s, prev), argnums=(0, 1))(xs, state)
        chunked = jax.grad(lambda xs, s: loss(lambda *a: delta_rule.gated_delta_chunked(*a[:5], CHUNK, *a[5:]),
                                              *xs, seg, s, prev), argnums=(0, 1))(xs, state)
        return (delta_rule.gated_delta_step(*xs, seg, state, prev),
                delta_rule.gated_delta_chunked(*xs, CHUNK, seg, state, prev),
                delta_rule.gated_delta_chunked(*xs, CHUNK)[0], step, chunked)

    (out1, s1), (out2, s2), unsegmented, step, chunked = jax.jit(both, compiler_options=FAST)(xs, state)
    np.testing.assert_allclose(out2, out1, atol=1e-5, rtol=0)
    np.testing.assert_allclose(s2, s1, atol=1e-5, rtol=0)
    assert np.abs(unsegmented - out2).max() > 1e-2  # the segments matter
    for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(step), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


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
    """qwen3-next-tiny in chunks of 4, cut to a linear-attention and an attention layer, both with
    dense MLPs (with the attention layer's MLP its routed experts, a few logits of one token
    differed by 7e-5 under cp; not traced), its Gated DeltaNet's weights 0.3 (not 0.02) so that they move
    the logits; logits and gradients on one device."""
    module, _ = get_model("qwen3-next-tiny", vocab_size=128, linear_attention_chunk=CHUNK, num_hidden_layers=2,
                          layer_types=(linear_attention.LINEAR, "full_attention"), mlp_layer_types=("dense", "dense"))
    batch = packed_batch()
    boxed = jax.eval_shape(module.init, jax.random.key(0), batch["inputs"])["params"]
    params = jax.device_get(nn.unbox(jax.jit(module.init)(jax.random.key(0), batch["inputs"])["params"]))
    rng = np.random.default_rng(1)
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: (0.3 * rng.normal(size=x.shape)).astype(np.float32)
        if "linear_attn" in jax.tree_util.keystr(p) and x.ndim >= 2 else x, params)
    (_, logits), grads = objective(module)(params, batch)
    return module, boxed, params, batch, jax.device_get((logits, grads))


def test_the_model_in_chunks_equals_the_model_step_by_step(reference, monkeypatch):
    module, _, params, batch, (logits, grads) = reference
    monkeypatch.setattr(linear_attention, "gated_delta_chunked", lambda q, k, v, g, beta, chunk, seg=None, state=None,
                        prev_seg=None: delta_rule.gated_delta_step(q, k, v, g, beta, seg, state, prev_seg))
    (_, step_logits), step_grads = objective(module)(params, batch)
    np.testing.assert_allclose(step_logits, logits, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(step_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    off = jax.tree_util.tree_map_with_path(
        lambda p, x: 0 * x if jax.tree_util.keystr(p).endswith("['linear_attn']['out']['kernel']") else x, params)
    (_, without), _ = objective(module)(off, batch)
    assert np.abs(without - logits).max() > 1e-2  # the linear-attention layers matter to the logits


def _state_permutes(hlo: str, local_batch: int) -> int:
    """Collective-permutes of [batch, heads, key_dim, value_dim] states (or their cotangents)."""
    shape = rf"f32\[{local_batch},{HEADS},{DK},{DV}\]"
    return permutes_of(hlo, shape)



def test_linear_attention_under_context_parallelism_equals_one_device(reference):
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
    permutes = _state_permutes(hlo, BATCH // 2)
    assert permutes >= 6, count_collectives(hlo)  # 2 x 3 hops of the state forward (and back for gradients)
    assert "/linear_attn/" in hlo and not length_gathers(hlo, LENGTH, "/linear_attn/")
    print(f"cp: {permutes} state collective-permutes, {count_collectives(hlo)}, max |logit diff| "
          f"{np.abs(cp_logits - logits).max():.1e}")


def test_plan_of_the_80b_preset_on_64_devices(capsys):
    """``shardzoo plan`` of qwen3-next-80b-a3b on an abstract 64-device mesh: its parameters are
    the preset's count (transformers' 79,674,391,296), the Gated DeltaNet's arrays are named by
    their logical axes (heads over tensor) and the activations count its layers, not attention's."""
    import json

    from shardzoo.cli import main
    from shardzoo.models import get_config

    assert main(["plan", "--model", "qwen3-next-80b-a3b", "--rules", "fsdp_tp", "--mesh", "fsdp=32,tensor=2",
                 "--seq-len", "4096", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_devices"] == 64 and data["abstract_mesh"]
    assert data["totals"]["param_count"] == get_config("qwen3-next-80b-a3b").num_params() == 79_674_391_296
    rows = {r["path"]: r for r in data["params"]}
    state_heads = rows["params/layers/sub_0/linear_attn/v/kernel"]
    assert state_heads["shape"] == [12, 2048, 32, 128] and state_heads["shard_shape"] == [12, 64, 16, 128]
    terms = get_config("qwen3-next-80b-a3b").activation_estimate(64, 4096, lambda names: 1).terms
    assert terms["gdn_chunk"] > 0 and "query" not in terms  # the first layer is a linear-attention layer


def test_the_decoding_cache_of_a_linear_attention_layer_is_counted():
    """``costs.decode_cache_bytes`` equals the bytes of the cache the Program makes (qwen3-next-tiny:
    3 Gated DeltaNet layers' states and convolution inputs, 1 attention layer's keys and values),
    and for the 80B preset each of its 36 Gated DeltaNet layers keeps 32 heads x 128 x 128 float32
    per row, whatever the length, and its convolution's last 3 inputs."""
    from shardzoo.models import get_config
    from shardzoo.models.costs import decode_cache_bytes
    from shardzoo.train.program import Program

    config = get_config("qwen3-next-tiny")
    shapes, _ = Program(config, get_rules("fsdp"), make_mesh("fsdp=8")).decoding.cache_shardings(8, 32)
    per_layer = {name: sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))
                 for name, tree in shapes.items()}
    counted = decode_cache_bytes(config.arch, 8, 32, 4)
    assert counted["linear_attention"] == sum(per_layer[f"layers_{i}"] for i in range(3))
    assert counted["attention"] == per_layer["layers_3"]
    big = decode_cache_bytes(get_config("qwen3-next-80b-a3b").arch, 1, 1024, 2)
    state, conv = 32 * 128 * 128 * 4 + 4, 3 * ((2 * 16 * 128 + 32 * 128) * 2 + 4)  # and their segment ids
    assert big["linear_attention"] == 36 * (state + conv)
    assert big["attention"] == 12 * (1024 * (2 * 2 * 256 * 2 + 4) + 4)


def test_plan_counts_the_linear_attention_layers_within_15_percent_of_the_compiled_step():
    """qwen3-next-tiny, 16 x 64 under fsdp=8: the plan's total and temporaries against XLA's.
    Measured 1.08 / 1.09 (the pattern), 0.99 (every layer linear attention), 0.86 (chunks of 16)."""
    from shardzoo.models import get_config
    from shardzoo.train.config import TrainConfig
    from shardzoo.train.tasks.registry import run_program

    config = get_config("qwen3-next-tiny")
    program = run_program(TrainConfig(batch_size=16, seq_len=64), config, get_rules("fsdp"), make_mesh("fsdp=8"))
    totals, memory = program.plan().totals, program.compile_report()["memory"]
    assert 0.85 < totals["total"] / memory["total"] < 1.15, (totals, memory)
    temp = totals["activations"] + totals["gradients"]
    assert 0.85 < temp / memory["temp"] < 1.15, (temp, memory)
    attention = config.replace(layer_types=None)  # every layer attention: another count
    assert config.num_params() - attention.num_params() == 3 * (
        64 * (2 * 16 + 2 * 48 + 2 * 4) + 48 * 64 + 4 * (2 * 16 + 48) + 8 + 12  # GDN: in, out, taps, A_log, dt_bias, norm
        - (64 * 16 * (2 * 4 + 2 * 2) + 64 * 16 * 4 + 2 * 16))  # attention: q, k, v, o, gate, q/k norms


def test_the_unit_lower_inverse_and_its_gradient_equal_a_triangular_solve():
    """``unit_lower_inverse`` (forward substitution with its own backward) equals XLA's triangular
    solve of the identity, and so do the gradients through it (1e-5)."""
    from shardzoo.models.delta_rule import unit_lower_inverse

    rng = np.random.default_rng(0)
    strict = jnp.asarray(np.tril(rng.normal(size=(2, 3, 8, 8)) * 0.3, k=-1), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(2, 3, 8, 5)), jnp.float32)

    def solved(s):
        return jax.scipy.linalg.solve_triangular(s + jnp.eye(8), jnp.broadcast_to(jnp.eye(8), s.shape), lower=True,
                                                 unit_diagonal=True)

    ours, theirs = unit_lower_inverse(strict), solved(strict)
    assert float(jnp.max(jnp.abs(ours - theirs))) < 1e-5
    grad = lambda f: jax.grad(lambda s: jnp.sum(jnp.sin(f(s) @ rhs)))(strict)  # noqa: E731
    g_ours, g_theirs = grad(unit_lower_inverse), grad(solved)
    mask = np.tri(8, k=-1, dtype=bool)
    assert float(jnp.max(jnp.abs(jnp.where(mask, g_ours - g_theirs, 0.0)))) < 1e-5
    assert float(jnp.max(jnp.abs(jnp.where(mask, 0.0, g_ours)))) == 0.0  # only the strict lower part varies
