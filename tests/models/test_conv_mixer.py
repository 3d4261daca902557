"""The gated short convolution (models/conv_mixer.py): its causal depthwise convolution against
numpy, segments respected, and context parallelism: each ring chunk's taps fed the previous
chunk's last inputs by collective-permutes (the zig-zag order's two neighbours), logits and
gradients equal one device's (1e-5), the sequence never gathered. fp32, lfm2-tiny's pattern.
"""

import os
import sys

import jax
import numpy as np
import pytest
from flax import linen as nn

from shardzoo.models import ModelError, get_model
from shardzoo.models.conv_mixer import causal_conv
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.sharding.partition import Placement, activate, logical_shardings
from shardzoo.train.jit import count_collectives

sys.path.insert(0, os.path.dirname(__file__))
from mixer_checks import length_gathers, objective, permutes_of  # noqa: E402

BATCH, LENGTH, WIDTH = 4, 48, 4  # 48 tokens over context=4: 8 chunks of 6 >= WIDTH - 1
TINY = dict(hidden_size=32, intermediate_size=64, vocab_size=128, num_hidden_layers=2, max_position_embeddings=64,
            conv_kernel=WIDTH, layer_types=("conv", "full_attention"))


def packed_batch(seed=0) -> dict:
    """Rows of 2-4 documents: segment ids 1, 2, ... and positions restarting at each."""
    rng = np.random.default_rng(seed)
    seg = np.sort(rng.integers(1, 5, (BATCH, LENGTH)), axis=1).astype(np.int32)
    starts = np.concatenate([np.ones((BATCH, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    idx = np.broadcast_to(np.arange(LENGTH), (BATCH, LENGTH))
    positions = (idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1)).astype(np.int32)
    return {"inputs": rng.integers(0, 128, (BATCH, LENGTH)).astype(np.int32), "positions": positions,
            "segment_ids": seg}


def test_causal_conv_equals_a_loop_and_respects_segments():
    rng = np.random.default_rng(0)
    x, kernel = rng.normal(size=(2, 9, 5)).astype(np.float32), rng.normal(size=(3, 5)).astype(np.float32)
    seg = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1, 1, 1]], np.int32)
    want = np.zeros_like(x)
    for b in range(2):
        for t in range(9):
            for k in range(3):
                s = t - 2 + k  # tap k reads token t - (w - 1) + k
                if s >= 0 and seg[b, s] == seg[b, t]:
                    want[b, t] += kernel[k] * x[b, s]
    np.testing.assert_allclose(causal_conv(x, kernel, seg), want, atol=1e-6, rtol=0)
    plain = np.asarray(causal_conv(x, kernel))  # no segments: every earlier tap counts
    assert np.abs(plain - want).max() > 1e-2



@pytest.fixture(scope="module")
def reference():
    module, _ = get_model("lfm2-tiny", **TINY)
    batch = packed_batch()
    boxed = jax.eval_shape(module.init, jax.random.key(0), batch["inputs"])["params"]
    params = jax.device_get(nn.unbox(jax.jit(module.init)(jax.random.key(0), batch["inputs"])["params"]))
    # the conv layer's weights large enough (0.3, not 0.02) that it moves the logits
    rng = np.random.default_rng(1)
    conv = params["layers_0"]["conv"]
    for name in ("in_b", "in_c", "in_x"):
        conv[name]["kernel"] = (0.3 * rng.normal(size=conv[name]["kernel"].shape)).astype(np.float32)
    conv["kernel"] = (0.3 * rng.normal(size=conv["kernel"].shape)).astype(np.float32)
    f = objective(module)
    (_, logits), grads = f(params, batch)
    off = jax.tree.map(lambda x: x, params)
    off["layers_0"]["conv"] = dict(conv, kernel=0 * conv["kernel"])
    (_, without), _ = f(off, batch)
    assert np.abs(without - logits).max() > 1e-2  # the convolution matters to the logits
    return module, boxed, params, batch, jax.device_get((logits, grads))


def _tail_permutes(hlo: str, local_batch: int, channels: int) -> int:
    """Collective-permutes of the convolution's tails: [batch, WIDTH - 1, channels] inputs (or
    their cotangents) and [batch, WIDTH - 1] segment ids."""
    shapes = (rf"f32\[{local_batch},{WIDTH - 1},{channels}\]", rf"s32\[{local_batch},{WIDTH - 1}\]")
    return sum(permutes_of(hlo, s) for s in shapes)



@pytest.mark.parametrize("preset, mesh", [("cp", "context=4,data=2"), ("cp_fsdp", "context=2,fsdp=4")])
def test_conv_under_context_parallelism_equals_one_device(reference, preset, mesh):
    module, boxed, params, batch, (logits, grads) = reference
    mesh, rules = make_mesh(mesh), get_rules(preset)
    f = objective(module.clone(placement=Placement(mesh, rules)))
    with activate(mesh):
        params = jax.device_put(params, logical_shardings(boxed, mesh, rules))
        compiled = f.lower(params, batch).compile()
    (_, cp_logits), cp_grads = compiled(params, batch)
    np.testing.assert_allclose(cp_logits, logits, rtol=0, atol=1e-5)
    for path, a in jax.tree_util.tree_flatten_with_path(cp_grads)[0]:
        b = grads
        for key in path:
            b = b[key.key]
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    conv_grad = grads["layers_0"]["conv"]["kernel"]
    assert float(np.abs(conv_grad).max()) > 1e-4  # the taps learn (70x the tolerance)
    hlo = compiled.as_text()
    local_batch = BATCH // (2 if preset == "cp" else 4)
    # forward: two tails of inputs and two of segment ids; backward: the inputs' cotangents back
    tails = _tail_permutes(hlo, local_batch, 32)
    assert tails >= 6, count_collectives(hlo)
    # no device gathers the row in a conv layer (under cp_fsdp the embedding lookup is gathered by
    # length, as for every model: embed is sharded over fsdp; not the convolution's doing)
    assert "/conv/" in hlo and not length_gathers(hlo, LENGTH, "/conv/")
    print(f"{preset}: {tails} tail collective-permutes, {count_collectives(hlo)}, max |logit diff| "
          f"{np.abs(cp_logits - logits).max():.1e}")


def test_a_chunk_shorter_than_the_taps_is_a_one_line_error(reference):
    module, _, params, _, _ = reference  # the parameters do not depend on the length
    batch = {k: v[:, :16] for k, v in packed_batch().items()}  # 16 tokens over context=4: chunks of 2 < 3
    mesh = make_mesh("context=4,data=2")
    ring = module.clone(placement=Placement(mesh, get_rules("cp")))
    for build in (lambda: objective(ring)(params, batch), lambda: ring.init(jax.random.key(0), batch["inputs"])):
        with pytest.raises(ModelError, match=r"chunks of 2; the short convolution \(conv_kernel=4\) needs 3 tokens"):
            with activate(mesh):
                build()


def test_plan_counts_the_conv_layers_within_15_percent_of_the_compiled_step():
    """lfm2-tiny (conv and attention layers scanned in periods of 2), 16 x 64 under fsdp=8: the
    plan's total and temporaries against XLA's. Measured 0.90 / 0.90 (0.86 before the qk-norm's
    float32 intermediates were counted; an all-conv stack: 1.00). Its parameters, FLOPs and
    activations count conv layers, not attention, where the pattern says so."""
    from shardzoo.models import get_config
    from shardzoo.train.config import TrainConfig
    from shardzoo.train.tasks.registry import run_program

    config = get_config("lfm2-tiny")
    program = run_program(TrainConfig(batch_size=16, seq_len=64), config, get_rules("fsdp"), make_mesh("fsdp=8"))
    totals, memory = program.plan().totals, program.compile_report()["memory"]
    assert 0.85 < totals["total"] / memory["total"] < 1.15, (totals, memory)
    temp = totals["activations"] + totals["gradients"]
    assert 0.85 < temp / memory["temp"] < 1.15, (temp, memory)
    d, w = config.hidden_size, config.conv.kernel
    attention = config.replace(layer_types=None)  # the same model, every layer attention
    assert config.num_params() - attention.num_params() == 2 * (4 * d * d + w * d - 2 * d * 64 - 2 * d * 32 - 2 * 16)
    conv = config.activation_estimate(16, 64, lambda names: 1)
    assert conv.terms["conv_input"] > 0 and "query" not in conv.terms  # the first layer is a conv layer
    assert "2 of them conv layers" in conv.formula
    # 6 x (the conv's matmuls and taps - attention's projections) - attention's 32 keys a query sees, per conv layer
    per_layer = 6 * (4 * d * d + w * d - d * 16 * (2 * 4 + 2 * 2)) - 6 * 4 * (16 + 16) * 32
    assert config.flops_per_token(64) - attention.flops_per_token(64) == 2 * per_layer
