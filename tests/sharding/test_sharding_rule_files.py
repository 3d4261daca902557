"""Rule files (YAML and JSON, with ``base:``) change the plan as their rules say; bad files error."""

import json

import pytest

from shardzoo.models import get_config
from shardzoo.sharding import RuleError, ShardingValidationError, get_rules
from shardzoo.train.program import plan

CONFIG = get_config("mlp-tiny", in_features=16, width=32, num_outputs=8)
MESH = "fsdp=2,tensor=4"


def _specs(rules):
    p = plan(CONFIG, rules, MESH, batch_size=8)
    return {r.array.path: r.shard_shape for r in p.params}, p


def test_yaml_with_base_adds_its_rules_in_front(tmp_path):
    path = tmp_path / "fsdp_mlp.yaml"
    path.write_text("# fsdp, plus the hidden width over tensor\nbase: fsdp\nrules:\n  - [mlp, tensor]\n")
    rules = get_rules(str(path))
    assert rules[0] == ("mlp", "tensor") and tuple(rules[1:]) == tuple(get_rules("fsdp"))
    assert "base fsdp" in rules.name
    base, _ = _specs("fsdp")
    ours, p = _specs(str(path))
    # fsdp alone: kernels split over fsdp=2 along embed only.
    assert base["params/layers_0/kernel"] == (8, 32) and base["params/layers_0/bias"] == (32,)
    # The file's rule also splits mlp over tensor=4; vocab has no such rule and stays whole.
    assert ours["params/layers_0/kernel"] == (8, 8) and ours["params/layers_0/bias"] == (8,)
    assert ours["params/layers_1/kernel"] == (8, 16)
    assert ours["params/head/kernel"] == (16, 8) and ours["params/head/bias"] == (8,)
    assert p.totals["params"] < plan(CONFIG, "fsdp", MESH, batch_size=8).totals["params"]


def test_json_file_with_base(tmp_path):
    path = tmp_path / "dp_embed.json"
    path.write_text(json.dumps({"base": "dp", "rules": [["embed", "fsdp"], ["vocab", ["tensor"]]]}))
    ours, p = _specs(str(path))
    assert ours["params/layers_0/kernel"] == (8, 32)  # embed over fsdp=2
    assert ours["params/head/kernel"] == (16, 2)  # embed over fsdp, vocab 8 over tensor=4
    assert p.rules[1] == ("vocab", "tensor")


def test_file_without_base_must_cover_every_name(tmp_path):
    path = tmp_path / "partial.yaml"
    path.write_text("- [batch, data]\n- [embed, fsdp]\n- [mlp, null]\n")
    with pytest.raises(ShardingValidationError) as e:
        plan(CONFIG, str(path), MESH, batch_size=8)
    [problem] = e.value.problems
    assert problem.kind == "no_rule" and "'vocab'" in problem.message
    assert "params/head/kernel" in problem.message and "partial.yaml" in problem.message


@pytest.mark.parametrize(
    "name, text, words",
    [
        ("syntax.yaml", "base: fsdp\nrules: [[mlp, tensor]\n", ["syntax.yaml", "cannot parse"]),
        ("syntax.json", '{"rules": [["mlp", "tensor"],]}', ["syntax.json", "cannot parse"]),
        ("keys.yaml", "bass: fsdp\n", ["keys.yaml", "bass"]),
        ("pair.yaml", "rules:\n  - [mlp, tensor, extra]\n", ["pair.yaml", "expected a [logical_name, mesh_axes] pair"]),
        ("logical.yaml", "rules:\n  - [hidden, tensor]\n", ["logical.yaml", "'hidden'"]),
        ("base.yaml", "base: zero3\nrules: []\n", ["base.yaml", "zero3"]),
        ("scalar.yaml", "42\n", ["scalar.yaml", "list"]),
    ],
)
def test_malformed_files_are_rule_errors(tmp_path, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(RuleError) as e:
        get_rules(str(path))
    for w in words:
        assert w in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_file_is_a_rule_error(tmp_path):
    with pytest.raises(RuleError, match="nope.yaml"):
        get_rules(str(tmp_path / "nope.yaml"))


def test_unknown_mesh_axis_in_a_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("base: fsdp\nrules:\n  - [mlp, tensr]\n")
    with pytest.raises(ShardingValidationError) as e:
        plan(CONFIG, str(path), MESH, batch_size=8)
    [problem] = e.value.problems
    assert problem.kind == "unknown_mesh_axis"
    assert "'tensr'" in problem.message and "typo.yaml" in problem.message


def test_printed_table_has_a_row_per_logical_axis_with_its_fallbacks(tmp_path):
    """A file's rule in front of its base's shows the base's rule for that name as its fallback;
    a preset's replicated tail shows as "(else -)", not as a second row of the same name."""
    path = tmp_path / "r.yaml"
    path.write_text("base: fsdp\nrules:\n  - [mlp, tensor]\n  - [embed, [fsdp, tensor]]\n")
    rows = str(get_rules(str(path))).splitlines()[2:]
    names = [row.split()[0] for row in rows]
    assert len(names) == len(set(names))
    assert "  mlp " in rows[0] and rows[0].endswith("tensor (else -)")
    assert rows[1].split(None, 1)[1] == "fsdp,tensor (else fsdp) (else -)"
