"""Context parallelism (``cp``, ring attention) equals one device; ``sp`` shards what it says.

llama-tiny (GQA) and mistral-tiny (a window shorter than the row) at one layer, packed rows of
several documents each (segment ids, positions restarting per document), fp32.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from shardzoo.cli import main
from shardzoo.errors import UserError
from shardzoo.models import get_model
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.sharding.partition import Placement, activate, logical_shardings
from shardzoo.train.config import TrainConfig
from shardzoo.train.jit import count_collectives
from shardzoo.train.tasks.registry import run_program

TINY = dict(hidden_size=32, intermediate_size=64, vocab_size=128, num_hidden_layers=1,
            max_position_embeddings=64)
# No parameter has a dimension of 48, so an all-gather whose result holds 48 gathers the length.
BATCH, LENGTH = 4, 48
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
MESHES = {"cp": "context=4,data=2", "cp_fsdp": "context=2,fsdp=4"}


def packed_batch(seed=0, batch=BATCH, length=LENGTH, vocab=128) -> dict:
    """Rows of 2-4 documents: segment ids 1, 2, ... and positions restarting at each."""
    rng = np.random.default_rng(seed)
    seg = np.sort(rng.integers(1, 5, (batch, length)), axis=1).astype(np.int32)
    starts = np.concatenate([np.ones((batch, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    idx = np.broadcast_to(np.arange(length), (batch, length))
    positions = (idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1)).astype(np.int32)
    tokens = rng.integers(0, vocab, (batch, length + 1)).astype(np.int32)
    weights = (rng.random((batch, length)) > 0.1).astype(np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": positions,
            "segment_ids": seg, "weights": weights}


def attention_length_gathers(hlo: str) -> list[str]:
    """The all-gathers inside attention whose result spans the whole row (a dimension LENGTH)."""
    found = []
    for line in hlo.splitlines():
        shape = re.search(r"= \S*?\[([\d,]*)\]\S* all-gather(?:-start)?\(", line)
        if shape and str(LENGTH) in shape.group(1).split(",") and "/attn/" in line:
            found.append(line.strip()[:160])
    return found


def _objective(module):
    def f(params, batch):
        logits = module.apply({"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"])
        probe = jnp.cos(0.01 * jnp.arange(logits.size, dtype=jnp.float32)).reshape(logits.shape)
        return jnp.mean(logits * probe), logits

    return jax.jit(jax.value_and_grad(f, has_aux=True), compiler_options=FAST)


def _logits_under_cp_equal_one_device(module, batch) -> str:
    """The forward under ``cp`` (context=4,data=2) gives one device's logits (1e-5); its HLO."""
    params = jax.device_get(nn.unbox(jax.jit(module.init)(jax.random.key(0), batch["inputs"])["params"]))
    def forward(module):
        return jax.jit(lambda p, b: module.apply({"params": p}, b["inputs"], b["positions"], b["segment_ids"]))

    one = forward(module)(params, batch)
    mesh = make_mesh(MESHES["cp"])
    with activate(mesh):
        compiled = forward(module.clone(placement=Placement(mesh, get_rules("cp")))).lower(params, batch).compile()
    np.testing.assert_allclose(compiled(params, batch), one, rtol=0, atol=1e-5)
    return compiled.as_text()


@pytest.fixture(scope="module", params=["llama-tiny", "mistral-tiny"])
def reference(request):
    module, config = get_model(request.param, **TINY)
    assert request.param == "llama-tiny" or config.sliding_window < LENGTH // 4  # crosses chunks
    batch = packed_batch()
    boxed = jax.eval_shape(module.init, jax.random.key(0), batch["inputs"])["params"]
    params = jax.device_get(nn.unbox(jax.jit(module.init)(jax.random.key(0), batch["inputs"])["params"]))
    (_, logits), grads = _objective(module)(params, batch)
    return module, boxed, params, batch, jax.device_get((logits, grads))


@pytest.mark.parametrize("preset", list(MESHES))
def test_ring_attention_logits_and_gradients_equal_one_device(reference, preset):
    module, boxed, params, batch, (logits, grads) = reference
    mesh, rules = make_mesh(MESHES[preset]), get_rules(preset)
    f = _objective(module.clone(placement=Placement(mesh, rules)))
    with activate(mesh):
        params = jax.device_put(params, logical_shardings(boxed, mesh, rules))
        compiled = f.lower(params, batch).compile()
    (_, ring_logits), ring_grads = compiled(params, batch)
    hlo = compiled.as_text()
    np.testing.assert_allclose(ring_logits, logits, rtol=0, atol=1e-5)
    for path, a in jax.tree_util.tree_flatten_with_path(ring_grads)[0]:
        b = grads
        for key in path:
            b = b[key.key]
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-3  # not all ~0
    assert count_collectives(hlo)["collective-permute"] > 0  # the ring
    assert not attention_length_gathers(hlo)  # no device gathers the whole row's K/V


def test_all_gather_strategy_equals_one_device_and_gathers_the_row():
    """``context_attention="all_gather"``: each device's queries against the whole row's K/V."""
    module, _ = get_model("mistral-tiny", context_attention="all_gather", **TINY)
    hlo = _logits_under_cp_equal_one_device(module, packed_batch(seed=5))
    assert attention_length_gathers(hlo)


def test_three_adamw_steps_of_the_program_give_one_devices_losses():
    module, config = get_model("llama-tiny", **TINY)
    cfg = TrainConfig(batch_size=BATCH, seq_len=LENGTH, lr=1e-2, warmup_steps=0, steps=3)
    batches = [packed_batch(seed) for seed in range(3)]

    def losses(rules, mesh):
        program = run_program(cfg, config, get_rules(rules), mesh)
        state, step = program.init(jax.random.key(0)), program.compiled_train_step()
        out = []
        for batch in batches:
            state, metrics = step(state, program.place(batch), jax.random.PRNGKey(1))
            out.append(float(metrics["loss"]))
        return np.array(out)

    one = losses("dp", make_mesh("data=1", devices=jax.devices()[:1]))
    assert one[-1] != one[0]
    for preset, spec in MESHES.items():
        np.testing.assert_allclose(losses(preset, make_mesh(spec)), one, rtol=0, atol=1e-5, err_msg=preset)


def test_a_length_the_ring_cannot_split_is_a_one_line_error(capsys):
    _, config = get_model("llama-tiny", **TINY)
    with pytest.raises(UserError, match=r"sequence length 36 .* mesh axis context=4 .* 2 x 4"):
        run_program(TrainConfig(batch_size=BATCH, seq_len=36), config, get_rules("cp"),
                    make_mesh(MESHES["cp"]))
    status = main(["plan", "--model", "llama-tiny", "--rules", "cp", "--mesh", "context=8",
                   "--seq-len", "40"])
    err = capsys.readouterr().err
    assert status == 2 and "sequence length 40 is not divisible by 16" in err
    assert len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------------------- sp
def test_sp_shards_the_residual_stream_by_length_and_leaves_attention_to_xla():
    """Under ``sp`` the compiled step's residual stream between blocks is [batch/data,
    length/sequence, embed] per device, and attention gathers the keys/values along the length
    (XLA's attention, no ring), where ``cp``'s ring gathers no length."""
    module, config = get_model("llama-tiny", **TINY)
    cfg = TrainConfig(batch_size=BATCH, seq_len=LENGTH)
    program = run_program(cfg, config, get_rules("sp"), make_mesh("data=2,sequence=2,tensor=2"))
    sp_hlo = program.compiled_train_step().as_text()
    # The norms between blocks (each block's two, the final one) work on [2, 24, 32] slices
    # of the residual stream per device, never on a whole row.
    d = TINY["hidden_size"]
    norm_shapes = set()
    for line in sp_hlo.splitlines():
        shape = re.search(r"= f32\[(\d+),(\d+),(\d+)\]\S* ", line)
        if shape and int(shape.group(3)) == d and re.search(r'op_name="[^"]*(attn_norm|mlp_norm|final_norm)', line):
            norm_shapes.add(tuple(map(int, shape.groups())))
    residual = [sh for sh in norm_shapes if sh[0] == BATCH // 2]
    assert residual == [(BATCH // 2, LENGTH // 2, d)], norm_shapes
    # XLA's attention gathers the keys/values along the length (cp's ring does not: above).
    assert attention_length_gathers(sp_hlo)


@pytest.mark.parametrize("name", ["gemma2-tiny", "gemma3-tiny"])
def test_gemma_local_global_layers_under_cp_equal_one_device(name):
    """Gemma 2's soft-capped attention (plain XLA, its mask by position: right in the ring's
    token order) and Gemma 3's ring with each layer's own window and query scale."""
    module, config = get_model(name, **{**TINY, "num_hidden_layers": 2, "sliding_window": 8,
                                        "layer_types": ("sliding_attention", "full_attention")})
    assert [s.window for s in config.layer_specs()] == [8, None]
    hlo = _logits_under_cp_equal_one_device(module, packed_batch(seed=7))
    if not config.attn_logit_softcapping:
        assert count_collectives(hlo)["collective-permute"] > 0  # the ring


def test_chunked_attention_and_nope_temperature_under_cp_equal_one_device():
    """llama4-tiny cut to two layers (a chunked one: chunks of 4 by position, restarting per packed
    document, dense MLP; a temperature-tuned NoPE one, MoE) under cp: the chunked layer takes the
    masked XLA path, one device's logits."""
    module, config = get_model("llama4-tiny", hidden_size=32, intermediate_size=64, vocab_size=128,
                               max_position_embeddings=64, moe_dispatch="dropless", num_hidden_layers=2,
                               layer_types=("chunked_attention", "full_attention"), rope_layers=(True, False),
                               mlp_layer_types=("dense", "moe"))
    assert {s.chunk for s in config.layer_specs()} == {4, None}
    _logits_under_cp_equal_one_device(module, packed_batch())
