"""Strict validation: flax's matching re-run with winners and losers, and every reported problem."""

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from shardzoo.errors import UserError
from shardzoo.models import get_model
from shardzoo.models.layers import recording_constraints
from shardzoo.sharding import (
    PRESETS,
    Rules,
    ShardingValidationError,
    ShardingValidationWarning,
    check,
    make_abstract_mesh,
    make_mesh,
    match_dims,
)
from shardzoo.sharding.partition import Placement, activate
from shardzoo.sharding.rules import REPLICATED
from shardzoo.train.program import plan

SPECS = [
    ("batch", "length", "embed"),
    ("batch", "embed"),
    ("embed", "mlp"),
    ("mlp", "embed"),
    ("layers", "embed", "heads", "head_dim"),
    ("layers", "heads", "head_dim", "embed"),
    ("expert", "embed", "mlp"),
    ("batch", "length", "expert", "capacity"),
    ("batch", "length", "vocab"),
    ("vocab", "embed"),
    ("batch", None, "kv_heads"),
    ("cache_length", "batch", "kv_heads", "head_dim"),
]
# A table where names compete for one mesh axis, and a multi-axis rule comes first.
CONTESTED = Rules(
    [("embed", "tensor"), ("mlp", "tensor"), ("mlp", "fsdp"), ("batch", ("data", "fsdp")),
     ("batch", "data"), ("heads", ("tensor", "expert")), ("heads", "expert")],
    name="contested",
) + REPLICATED


@pytest.mark.parametrize("preset", [*PRESETS, "contested"])
def test_match_dims_equals_flax(preset):
    rules = CONTESTED if preset == "contested" else PRESETS[preset]
    for names in SPECS:
        ours = P(*(None if not d.mesh_axes else d.mesh_axes[0] if len(d.mesh_axes) == 1
                   else d.mesh_axes for d in match_dims(names, rules)))
        assert ours == nn.logical_to_mesh_axes(names, tuple(rules)), (preset, names)


def test_winners_and_losers_are_recorded():
    rules = PRESETS["fsdp"]  # #0 batch->(data,fsdp), #1 embed->fsdp, then replicated
    batch, embed = match_dims(("batch", "embed"), rules)
    assert (batch.winner, batch.mesh_axes, batch.losers) == (0, ("data", "fsdp"), ())
    assert embed.mesh_axes == () and rules[embed.winner] == ("embed", None)
    [lost] = embed.losers
    assert (lost.rule, lost.mesh_axes, lost.taken) == (1, ("fsdp",), ("fsdp",))
    # In a parameter nothing competes: embed wins fsdp by rule #1.
    e, m = match_dims(("embed", "mlp"), rules)
    assert (e.winner, e.mesh_axes, e.losers, m.mesh_axes) == (1, ("fsdp",), (), ())
    # Contested: mlp loses tensor to embed, then wins fsdp by its second rule.
    e, m = match_dims(("embed", "mlp"), CONTESTED)
    assert e.mesh_axes == ("tensor",) and m.mesh_axes == ("fsdp",) and m.winner == 2
    assert [lo.rule for lo in m.losers] == [1]


class Named(nn.Module):
    """A one-parameter model whose names and shape the test chooses."""

    names: tuple
    shape: tuple

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.with_logical_partitioning(nn.initializers.ones, self.names), self.shape)
        return x * jnp.sum(w)


def _abstract(module, x=None):
    x = jnp.zeros((8, 4)) if x is None else x
    return {"params": jax.eval_shape(module.init, jax.random.key(0), x)["params"]}


MESH = make_abstract_mesh("data=2,fsdp=2,tensor=2")


def _error(tree, rules, mesh=MESH, **kw):
    with pytest.raises(ShardingValidationError) as e:
        check(tree, rules, mesh, **kw)
    assert isinstance(e.value, UserError)
    return e.value


def test_placement_mesh_axes_alone_and_within_an_array():
    """``Placement.mesh_axes(name, within)``: where the rules put ``name`` in an array of those
    names (the first match over the whole array), axes of size 1 dropped; alone by default."""
    rules = Rules((("embed", "data"), ("vocab", "data"), ("vocab", "tensor")))
    placement = Placement(make_abstract_mesh("data=2,tensor=4"), rules)
    assert placement.mesh_axes("vocab") == ("data",)
    assert placement.mesh_axes("vocab", ("vocab", "embed")) == ("tensor",)  # embed took data
    assert placement.mesh_axes("embed", ("vocab", "embed")) == ("data",)
    assert Placement(make_abstract_mesh("data=2,tensor=1"), rules).mesh_axes("vocab", ("embed", "vocab")) == ()


def test_name_outside_the_vocabulary():
    err = _error(_abstract(Named(("embed", "bogus"), (4, 4))), PRESETS["fsdp"])
    [p] = err.problems
    assert p.kind == "unknown_name" and "params/w" in str(err) and "'bogus'" in str(err)


def test_name_with_no_rule():
    rules = Rules([("batch", "data"), ("embed", "fsdp")], name="partial")
    err = _error(_abstract(Named(("embed", "mlp"), (4, 4))), rules)
    [p] = err.problems
    assert p.kind == "no_rule"
    assert "params/w" in p.message and "'mlp'" in p.message and "'partial'" in p.message


def test_rule_naming_a_mesh_axis_the_mesh_lacks():
    rules = Rules([("embed", "fsdq")], name="typo") + REPLICATED
    err = _error(_abstract(Named(("embed", "mlp"), (4, 4))), rules)
    [p] = err.problems
    assert p.kind == "unknown_mesh_axis"
    assert "'fsdq'" in p.message and "embed->fsdq" in p.message and "tensor=2" in p.message


def test_indivisible_dimension_names_path_axes_sizes():
    err = _error(_abstract(Named(("embed", "mlp"), (6, 4))), PRESETS["fsdp"],
                 mesh=make_abstract_mesh("fsdp=4"))
    [p] = err.problems
    assert p.kind == "indivisible"
    for word in ("params/w", "dim 0 (embed)", "size 6", "fsdp=4", "(embed, mlp)", "(6, 4)"):
        assert word in p.message, word


def test_duplicate_name_and_unnamed_dims():
    err = _error(_abstract(Named(("embed", "embed"), (4, 4))), PRESETS["dp"])
    assert [p.kind for p in err.problems] == ["duplicate"]
    err = _error(_abstract(Named(("embed", None), (4, 4))), PRESETS["dp"])
    assert [p.kind for p in err.problems] == ["unnamed"]


def test_all_problems_gathered_one_per_line_and_summary():
    # MLP width 30 under tp on tensor=4: three parameters and one activation do not divide.
    module, config = get_model("mlp-tiny", width=30)
    with pytest.raises(ShardingValidationError) as e:
        plan(config, "tp", "data=2,tensor=4", batch_size=8)
    lines = str(e.value).splitlines()
    assert len(lines) == len(e.value.problems) == 4
    assert any(line.startswith("activations/MLP#1: dim 1 (mlp) of size 30") for line in lines)
    assert e.value.summary("tp: ").splitlines() == ["tp: 4 sharding problems:", *("  " + x for x in lines)]
    [one] = e.value.problems[:1]
    assert ShardingValidationError([one]).summary("tp: ", "hint") == f"tp: {one.message} [hint]"


def test_activation_problem_names_the_activation_path():
    module, config = get_model("llama-tiny", num_hidden_layers=1)
    with pytest.raises(ShardingValidationError) as e:  # sp: length 5 over sequence=2
        plan(config, "sp", "data=2,sequence=2,tensor=2", batch_size=2, seq_len=5)
    assert e.value.problems and all(p.path.startswith("activations/") for p in e.value.problems)
    assert "dim 1 (length) of size 5 is not divisible by mesh axes sequence=2" in str(e.value)


def test_a_batch_the_devices_cannot_split_is_one_line_naming_the_microbatch():
    module, config = get_model("mlp-tiny")
    with pytest.raises(UserError, match=r"microbatch of 6 rows .* not divisible by the 8 devices"):
        plan(config, "dp", "data=8", batch_size=6)


def test_non_strict_warns_and_replicates_what_does_not_divide():
    module, config = get_model("mlp-tiny", width=30)
    with pytest.warns(ShardingValidationWarning) as record:
        p = plan(config, "tp", "data=2,tensor=4", batch_size=8, strict=False)
    assert len(record) == 4 and len(p.problems) == 4
    rows = {r.array.path: r for r in p.params}
    kernel = rows["params/layers_0/kernel"]
    assert kernel.shard_shape == (16, 30) and kernel.array.dims[1].dropped == ("tensor",)
    assert rows["params/head/kernel"].shard_shape == (30, 1)  # vocab 4 still splits over tensor=4
    # A rule naming an unknown mesh axis is dropped with a warning; the rest still applies.
    rules = Rules([("mlp", "tensr")], name="typo") + PRESETS["tp"]
    with pytest.warns(ShardingValidationWarning, match="tensr"):
        p = plan(get_model("mlp-tiny")[1], rules, "data=2,tensor=4", batch_size=8, strict=False)
    rows = {r.array.path: r for r in p.params}
    assert rows["params/layers_0/kernel"].shard_shape == (16, 8)


def test_record_activations_sees_constraints_not_parameters():
    _, config = get_model("mlp-tiny")
    mesh = make_mesh("data=8")
    module = config.build(Placement(mesh, PRESETS["dp"]))
    with activate(mesh), recording_constraints() as sites:
        jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((8, 16)))
    got = [(path, names, shape) for path, names, shape, _ in sites]
    assert got == [
        ("MLP#0", ("batch", "embed"), (8, 16)),
        ("MLP#1", ("batch", "mlp"), (8, 32)),
        ("MLP#2", ("batch", "embed"), (8, 32)),
        ("MLP#3", ("batch", "vocab"), (8, 4)),
    ]


def test_report_shardings_follow_the_tree():
    tree = _abstract(Named(("embed", "mlp"), (4, 4)))
    report = check(tree, PRESETS["fsdp_tp"], MESH)
    sharding = report.shardings(MESH)["params"]["w"]
    assert sharding.spec == P("fsdp", "tensor") and sharding.shard_shape((4, 4)) == (2, 2)
