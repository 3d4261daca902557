"""Qwen3-MoE with dense and MoE layers mixed (``decoder_sparse_step`` and ``mlp_only_layers``):
logits of transformers on one device and under ep, HF's load-balancing loss, drops, export.

Every-layer-MoE Qwen3-MoE (scanned) runs the families' tests in test_hf_models.py (one device,
greedy generate, export; its experts under fsdp_tp: mixtral's there). The 9-layer pattern (an
unrolled prefix, a scanned period, an unrolled rest) imports, matches and generates here; its
gradients, scanned against unrolled: tests/models/test_tf_patterns.py. Tolerance: 1e-4 on float32 logits, as there.
"""

import os
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from shardzoo.models.hf import export_hf, load_hf_config
from shardzoo.sharding import get_rules
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOKENS,
    TOL,
    apply,
    apply_mutable,
    hf_logits,
    load_ep,
    one_device,
    randomized,
    saved,
)

E, K = 4, 2
# Layer 0 dense (mlp_only_layers), layer 1 MoE.
HF_CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=E,
                 num_experts_per_tok=K, moe_intermediate_size=16, mlp_only_layers=[0],
                 norm_topk_prob=True, router_aux_loss_coef=0.02)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF dir, HF model, reference logits): weights random, norm scales near 1."""
    return saved(randomized(Qwen3MoeConfig(**HF_CONFIG), seed=0), tmp_path_factory.mktemp("qwen3_moe"))


def test_moe_layers_are_those_hf_builds(tmp_path):
    """decoder_sparse_step and mlp_only_layers pick the MoE layers as Qwen3MoeDecoderLayer does,
    and the pattern imports with scanning on (no pattern is refused)."""
    hf_config = Qwen3MoeConfig(**(HF_CONFIG | dict(num_hidden_layers=7, decoder_sparse_step=2,
                                                   mlp_only_layers=[3, 4])))
    hf_config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    want = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in model.model.layers]
    assert want == [False, True, False, False, False, True, False]
    for scan in (False, True):
        config = load_hf_config(str(tmp_path), scan_layers=scan)
        assert [s.mlp == "moe" for s in config.arch.layer_specs()] == want
        assert config.num_params() == sum(p.numel() for p in model.parameters())
    assert config.scan_layers and config.layout().repeats >= 2  # scanned, not unrolled whole


# 9 layers: mlp_only_layers [0, 1] and MoE every second layer: D D D M D M D M D. Scanned as an
# unrolled prefix (layers 0, 1), three periods of (D, M) and an unrolled rest (layer 8).
PATTERN = dict(HF_CONFIG, vocab_size=320, num_hidden_layers=9, decoder_sparse_step=2, mlp_only_layers=[0, 1])


@pytest.fixture(scope="module")
def pattern(tmp_path_factory):
    model = randomized(Qwen3MoeConfig(**PATTERN), seed=3)  # a seed whose greedy continuation varies (deep random models repeat)
    path = str(tmp_path_factory.mktemp("qwen3_moe_pattern"))
    model.save_pretrained(path)
    return path, model


def test_a_pattern_with_prefix_and_rest_scans_and_equals_transformers_and_unrolled(pattern):
    path, model = pattern
    ref = hf_logits(model, TOKENS)
    mesh, rules = one_device(), get_rules("fsdp")
    module, config, params = load_hf(path, mesh=mesh, rules=rules)
    assert config.layout().as_tuple() == (2, 2, 3)  # prefix 2, period 2, 3 repeats, layer 8 unrolled
    assert set(params) >= {"layers_0", "layers_1", "layers_8", "layers"}
    assert set(params["layers"]) == {"sub_0", "sub_1"} and "moe" in params["layers"]["sub_1"]
    logits = apply(module, params, mesh)
    np.testing.assert_allclose(np.asarray(logits), ref, atol=TOL, rtol=0)

    # unrolled: the same logits (gradients of this pattern, scanned against unrolled:
    # tests/models/test_tf_patterns.py)
    flat_module, _, flat = load_hf(path, mesh=mesh, rules=rules, scan_layers=False)
    assert "layers" not in flat
    flat_logits = apply(flat_module, flat, mesh)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(flat_logits), atol=1e-5, rtol=0)


def test_a_pattern_with_prefix_and_rest_generates_as_transformers(pattern, parity):
    path, model = pattern
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_mixed_layers_import_unrolled_with_the_dense_and_moe_layers_hf_has(built):
    path, _, ref = built
    module, config, params = load_hf(path, scan_layers=False)
    assert [sorted(set(params[f"layers_{i}"]) & {"mlp", "moe"}) for i in range(2)] == [["mlp"], ["moe"]]
    assert params["layers_1"]["moe"]["wi_gate"].shape == (E, 32, 16)  # moe_intermediate_size
    assert params["layers_0"]["mlp"]["gate"]["kernel"].shape == (32, 64)  # intermediate_size
    logits, _ = apply_mutable(module, params)
    np.testing.assert_allclose(np.asarray(logits), ref, atol=TOL, rtol=0)


def test_logits_match_under_ep_on_8_devices_with_the_indexed_dispatch(built):
    path, _, ref = built
    # capacity factor E / K: every expert has a slot for every token, so nothing is dropped
    module, _, params, mesh = load_ep(path, scan_layers=False, moe_dispatch="indexed", capacity_factor=E / K)
    wi_gate = params["layers_1"]["moe"]["wi_gate"]
    assert wi_gate.addressable_shards[0].data.shape == (1, 32, 16)  # experts split 4 ways
    logits, state = apply_mutable(module, params, mesh, ["metrics"])
    np.testing.assert_allclose(np.asarray(logits), ref, atol=TOL, rtol=0)
    assert float(state["metrics"]["layers_1"]["moe"]["dropped_fraction"][0]) == pytest.approx(0, abs=1e-6)


def test_load_balancing_loss_is_hfs(built):
    path, model, _ = built
    with torch.no_grad():
        want = model(torch.tensor(TOKENS, dtype=torch.long), output_router_logits=True).aux_loss.item()
    module, config, params = load_hf(path, scan_layers=False)
    assert (config.moe.router_aux_loss_coef, config.router_z_loss_coef) == (0.02, 0.0)
    _, state = apply_mutable(module, params, collections=["losses", "metrics"])
    got = float(state["metrics"]["layers_1"]["moe"]["load_balance_loss"][0])
    assert got == pytest.approx(want, rel=1e-5) and got > K  # K: perfectly balanced
    aux = float(state["losses"]["layers_1"]["moe"]["moe_aux_loss"][0])
    assert aux == pytest.approx(0.02 * want, rel=1e-5)  # HF's coefficient, no z-loss


def test_dropped_tokens_are_the_capacity_dispatchs(built):
    """HF drops nothing; at capacity factor 0.5 the indexed and capacity dispatches drop the
    same assignments, so they agree with each other and not with transformers."""
    path, _, ref = built
    out = {}
    for dispatch in ("indexed", "capacity"):
        module, _, params = load_hf(path, scan_layers=False,
                                    overrides=dict(moe_dispatch=dispatch, capacity_factor=0.5))
        logits, state = apply_mutable(module, params, collections=["metrics"])
        out[dispatch] = np.asarray(logits), float(state["metrics"]["layers_1"]["moe"]["dropped_fraction"][0])
    np.testing.assert_allclose(out["indexed"][0], out["capacity"][0], atol=1e-5, rtol=0)
    assert out["indexed"][1] == pytest.approx(out["capacity"][1], abs=1e-6) and out["indexed"][1] > 0.2
    assert np.abs(out["indexed"][0] - ref).max() > 1e-2  # the drops change the logits


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, config, params = load_hf(path, scan_layers=False)
    hf = export_hf(config, params, str(tmp_path))
    assert (hf["decoder_sparse_step"], hf["mlp_only_layers"], hf["moe_intermediate_size"]) == (1, [0], 16)
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)
