"""The ``moe`` sub-record of the architecture (models/moe_arch.py): None on a dense model, built
alike from its flat names (``arch_of``, ``--override``, older checkpoints) and nested, canonical,
and its bad settings refused in one line naming the field."""

import json

import pytest

from shardzoo.cli import main
from shardzoo.models import ModelError, get_config
from shardzoo.models.arch import TransformerArch, arch_of
from shardzoo.models.features import used_features
from shardzoo.models.moe_arch import MoeArch
from shardzoo.models.transformer import TransformerConfig

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
MOE = dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=8, router_kind="softmax_groups",
           n_group=4, topk_group=2, shared_expert_intermediate_size=16, routed_scaling_factor=2.5)


def test_a_dense_arch_has_no_moe_record():
    assert get_config("llama-tiny").arch.moe is None and arch_of(**TINY).moe is None
    # a dense model's MoE values (older checkpoints stored them all, num_local_experts 0) read as none
    dense = arch_of(**TINY, num_local_experts=0, num_experts_per_tok=4, router_jitter_noise=0.1)
    assert dense == arch_of(**TINY) and dense.moe is None
    assert {s.mlp for s in dense.layer_specs()} == {"dense"} and "moe" not in used_features(dense)
    # MoE layers nowhere in mlp_layer_types: no record either
    assert arch_of(**TINY, **MOE, mlp_layer_types=("dense", "dense")) == arch_of(**TINY)


def test_flat_names_and_the_nested_record_build_the_same_arch():
    nested = TransformerArch(**TINY, moe=MoeArch(**MOE))
    assert arch_of(**TINY, **MOE) == nested == TransformerArch(**TINY, moe=dict(MOE))
    assert nested.moe.num_local_experts == 8 and [s.mlp for s in nested.layer_specs()] == ["moe", "moe"]
    # --override's strings, parsed to the record field's type, onto a dense preset
    overridden = get_config("llama-tiny", **{k: str(v) for k, v in MOE.items()})
    assert overridden.arch.moe == MoeArch(**MOE)
    assert get_config("llama-tiny").replace(**MOE).arch.moe == MoeArch(**MOE)
    # a flat name replaces one field of the record already there
    assert overridden.replace(num_experts_per_tok=3).arch.moe == MoeArch(**MOE | dict(num_experts_per_tok=3))
    # the features read the record's fields
    used = used_features(nested)
    assert used["moe"][0] == "num_local_experts=8" and used["group_limited_router"] == ["router_kind='softmax_groups'"]


def test_the_record_round_trips_through_its_stored_form():
    config = TransformerConfig.from_fields(**TINY, **MOE, mlp_layer_types=("dense", "moe"))
    stored = json.loads(json.dumps(config.to_dict()))
    assert stored["arch"]["moe"]["n_group"] == 4 and "num_local_experts" not in stored["arch"]
    assert TransformerConfig.from_dict(stored) == config
    flat = {k: v for k, v in stored["arch"].items() if k != "moe"} | config.arch.moe.flat()
    assert TransformerConfig.from_dict({"arch": flat, "execution": stored["execution"]}) == config


def test_the_record_is_canonical():
    assert arch_of(**TINY, num_local_experts=4, moe_intermediate_size=32).moe.moe_intermediate_size is None
    one_group = arch_of(**TINY, num_local_experts=4, router_kind="softmax_groups", n_group=1, topk_group=1).moe
    assert (one_group.router_kind, one_group.n_group, one_group.topk_group) == ("softmax", 1, 1)
    ungated = arch_of(**TINY, num_local_experts=4, shared_expert_gate=True).moe  # no shared expert to gate
    assert ungated == MoeArch(num_local_experts=4)
    assert arch_of(**TINY, num_local_experts=4, mlp_layer_types=("moe", "moe")).mlp_layer_types is None


@pytest.mark.parametrize("fields, words", [
    (dict(router_kind="topk"), "router_kind='topk' is not one of softmax, softmax_groups"),
    (dict(router_kind="softmax_groups", n_group=3), "n_group=3 must divide num_local_experts=8"),
    (dict(router_kind="sigmoid_groups", n_group=2, topk_group=3), "topk_group=3 must be at most n_group"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 must be in 1..num_local_experts=8"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor=0.0 must be a finite number > 0"),
    (dict(router_jitter_noise=1.5), "router_jitter_noise=1.5 must be in [0, 1)"),
    (dict(expert_type="plain", expert_bias=True), "expert_type='plain' (experts without a gate) takes neither"),
])
def test_a_bad_moe_setting_names_its_field_in_one_line(fields, words):
    with pytest.raises(ModelError) as e:
        arch_of(**TINY, num_local_experts=8, **fields)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_moe_layers_without_experts_and_dense_only_settings_are_refused():
    with pytest.raises(ModelError, match="mlp_layer_types has moe layers but num_local_experts is 0"):
        arch_of(**TINY, mlp_layer_types=("dense", "moe"))
    with pytest.raises(ModelError, match="hidden_act='xielu'.*num_local_experts=4"):
        arch_of(**TINY, num_local_experts=4, hidden_act="xielu")


def test_a_bad_router_override_is_one_line_with_status_2(capsys):
    status = main(["plan", "--model", "mixtral-tiny", "--mesh", "data=1", "--override", "router_kind=sigmoid_topk"])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "router_kind='sigmoid_topk' is not one of softmax, softmax_groups, sigmoid_groups" in err
