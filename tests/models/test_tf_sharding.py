"""Three adamw steps of tiny Llama (GQA) and GPT-2 give the same losses under every rule preset."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardzoo.models import get_model
from shardzoo.sharding import axes as ax
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.sharding.partition import Placement, activate, logical_shardings, spec_to_sharding
from shardzoo.train.program import Program

TINY = dict(hidden_size=32, intermediate_size=64, vocab_size=128, max_position_embeddings=32)
# Cheaper XLA:CPU compiles (about half the time); both sides of every comparison use them.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
BATCH, LENGTH, STEPS = 8, 16, 3

# preset -> (mesh, {q kernel's mesh spec [layers, embed, heads, head_dim]}); each mesh uses all 8
# devices and shards something the preset names.
CASES = {
    "dp": ("data=8", P(None, None, None, None)),
    "fsdp": ("fsdp=8", P(None, "fsdp", None, None)),
    "tp": ("data=4,tensor=2", P(None, None, "tensor", None)),
    "fsdp_tp": ("fsdp=4,tensor=2", P(None, "fsdp", "tensor", None)),
    "sp": ("data=2,sequence=2,tensor=2", P(None, None, "tensor", None)),
}


TX = optax.adamw(1e-2)


def _train(module, params, batch, shardings=None):
    """STEPS adamw steps of one jitted step (cheaper to compile than a scan over steps).

    ``shardings``: (params, optimizer state, batch) shardings, or None for one device.
    """

    def step(p, opt, batch):
        def loss_fn(p):
            logits = module.apply({"params": p}, batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, opt = TX.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt, loss

    step_kw = {}
    opt = TX.init(params)
    if shardings is not None:  # from host copies: placing them needs no resharding program
        step_kw = dict(in_shardings=shardings, out_shardings=(*shardings[:2], None))
        params, opt = jax.device_put((params, jax.device_get(opt)), shardings[:2])
    step = jax.jit(step, compiler_options=FAST, **step_kw)
    losses = []
    for _ in range(STEPS):
        params, opt, loss = step(params, opt, batch)
        losses.append(float(loss))
    return np.array(losses), params


# Llama with scanned layers, GPT-2 unrolled: both layouts of the parameter tree get sharded.
@pytest.fixture(scope="module", params=[("llama-tiny", True), ("gpt2-tiny", False)], ids=["llama", "gpt2"])
def model(request):
    name, scan = request.param
    module, config = get_model(name, scan_layers=scan, **TINY)
    x = jnp.zeros((BATCH, LENGTH), jnp.int32)
    boxed = jax.eval_shape(module.init, jax.random.key(0), x)["params"]
    params = jax.device_get(nn.unbox(jax.jit(module.init, compiler_options=FAST)(jax.random.key(0), x)["params"]))
    batch = np.asarray(jax.random.randint(jax.random.key(1), (BATCH, LENGTH + 1), 0, config.vocab_size))
    reference, _ = _train(module, params, batch)  # one batch repeated, so the loss must fall
    return module, boxed, params, batch, reference


@pytest.mark.parametrize("preset", list(CASES))
def test_losses_match_single_device(model, preset):
    module, boxed, params, batch, reference = model
    mesh_spec, q_spec = CASES[preset]
    mesh, rules = make_mesh(mesh_spec), get_rules(preset)
    placed = module.clone(placement=Placement(mesh, rules))
    with activate(mesh):
        shardings = logical_shardings(boxed, mesh, rules)
        opt_shardings = logical_shardings(jax.eval_shape(TX.init, boxed), mesh, rules)
        batch_sharding = spec_to_sharding((ax.BATCH, None), mesh, rules)
        losses, trained = _train(placed, params, batch, (shardings, opt_shardings, batch_sharding))
    q = (trained["layers"] if "layers" in trained else trained["layers_0"])["attn"]["q"]["kernel"]
    if "layers_0" in trained:
        q_spec = P(*q_spec[1:])
    assert q.sharding.is_equivalent_to(NamedSharding(mesh, q_spec), q.ndim)
    if preset != "dp":
        assert q.addressable_shards[0].data.size < q.size  # really sharded
    assert batch_sharding.spec[0] is not None  # the batch is split
    np.testing.assert_allclose(losses, reference, rtol=0, atol=1e-5)
    assert reference[-1] < reference[0]  # the steps train
    if preset == "sp":  # the activations between blocks are split along the length over `sequence`
        assert _between_blocks(placed, boxed, mesh, rules) == ['[{"data"}, {"sequence"}, {}]'] * (
            1 + 2 * _traced_blocks(boxed))


def _traced_blocks(boxed) -> int:
    """How many blocks the forward traces: one scanned body, or each unrolled layer."""
    return 1 if "layers" in boxed else sum(name.startswith("layers_") for name in boxed)


def _between_blocks(module, boxed, mesh, rules) -> list[str]:
    """Mesh specs of the sharding constraints on [batch, length, embed] activations in the
    lowered forward (Shardy's text): the embedding's output, then each block's two residual sums."""
    shardings = logical_shardings(boxed, mesh, rules)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nn.unbox(boxed), shardings)
    tokens = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)
    with activate(mesh):
        text = jax.jit(lambda p, t: module.apply({"params": p}, t)).lower(params, tokens).as_text()
    shape = f"{BATCH}x{LENGTH}x{TINY['hidden_size']}xf32"
    return re.findall(rf"sdy\.sharding_constraint %\S+ <@\w+, (\[.*\])> : tensor<{shape}>", text)


def test_block_constrains_its_outputs_under_fsdp_tp(model):
    """Every block's residual sums (and the embedding's output) are constrained to the batch over
    data and fsdp, the rest whole: two per block traced (the scanned body once), one for the input."""
    module, boxed, *_ = model
    mesh, rules = make_mesh(CASES["fsdp_tp"][0]), get_rules("fsdp_tp")
    specs = _between_blocks(module.clone(placement=Placement(mesh, rules)), boxed, mesh, rules)
    assert specs == ['[{"data", "fsdp"}, {}, {}]'] * (1 + 2 * _traced_blocks(boxed)), specs


def test_fused_projections_add_no_collectives_under_tp():
    """Stacking k|v and up|gate keeps their heads/mlp sharding: no collective is added."""
    mesh, rules = make_mesh("data=4,tensor=2"), get_rules("tp")
    x = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)
    counts = {}
    for fuse in (True, False):
        _, config = get_model("llama-tiny", fuse_projections=fuse, **TINY)
        program = Program(config, rules, mesh)
        module, params = program.module, program.params_target()  # with shardings
        with activate(mesh):
            tokens = jax.ShapeDtypeStruct(x.shape, x.dtype,
                                          sharding=spec_to_sharding((ax.BATCH, None), mesh, rules))

            def loss(p, tokens, module=module):
                return module.apply({"params": p}, tokens).mean()

            hlo = jax.jit(jax.grad(loss)).lower(params, tokens).compile(compiler_options=FAST).as_text()
        counts[fuse] = {op: hlo.count(f" {op}(") for op in ("all-gather", "all-reduce", "all-to-all",
                                                           "collective-permute")}
    assert counts[False]["all-reduce"] > 0  # tensor parallelism does communicate
    for op, n in counts[True].items():
        assert n <= counts[False][op], (op, counts)
