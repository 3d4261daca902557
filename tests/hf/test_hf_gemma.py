"""Gemma 1, 2 and 3 (text) against transformers: logits, greedy tokens and export round trips.

Tiny random models built here with the features that matter: Gemma's (1 + w) norms, scaled
tied embeddings, GeGLU and GQA; Gemma 2's four norms, soft-caps small enough to clip and a
window (4) shorter than the text (16) on alternate layers; Gemma 3's qk-norm, 5 local : 1
global over 8 layers (a scanned period of 6 and 2 unrolled layers), a local rotary base of its
own and a scaled global one. Tolerance: 1e-4 on float32 logits (measured ~6e-6).
"""

import json
import os
import sys

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GemmaConfig

from shardzoo import cli
from shardzoo.models.hf import export_hf, load_hf_config
from shardzoo.sharding import make_mesh
from shardzoo.sharding.rules import get_rules
from shardzoo.train.io.checkpoint import read_meta
from shardzoo.train.io.hf_io import load_hf
from shardzoo.train.io.sources import resolve_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
from harness import TOKENS, TOL, apply, hf_logits, one_device, randomized, saved  # noqa: E402

# head_dim 16, not hidden / heads = 8; vocab above the byte tokenizer's 259 ids (train)
DIMS = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
CONFIGS = {
    "gemma": lambda: GemmaConfig(**DIMS, num_hidden_layers=2),
    "gemma2": lambda: Gemma2Config(**DIMS, num_hidden_layers=4, sliding_window=4,
                                   query_pre_attn_scalar=24, attn_logit_softcapping=1.0,
                                   final_logit_softcapping=0.5),
    "gemma3": lambda: Gemma3TextConfig(**DIMS, num_hidden_layers=8, sliding_window=4,
                                       query_pre_attn_scalar=24, rope_theta=10000.0,
                                       rope_local_base_freq=100.0,
                                       rope_scaling={"rope_type": "linear", "factor": 4.0}),
}


def draw(name, p):
    """Every weight random; Gemma's norms scale by (1 + w), so their w is near 0. Small tied
    embeddings against larger layers keep greedy decoding off a repeated token."""
    return (0.1 if "norm" in name else 0.05 if "embed" in name else 0.3) * torch.randn_like(p)


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    """(HF dir, HF model, reference logits) for one generation."""
    return saved(randomized(CONFIGS[request.param](), 0, draw), tmp_path_factory.mktemp(request.param))


def test_config_reads_every_feature(built):
    path, model, _ = built
    config = load_hf_config(path)
    assert (config.norm_type, config.scale_embeddings, config.tie_word_embeddings) == (
        "rmsnorm_plus_one", True, True)
    assert config.hidden_act == "gelu_pytorch_tanh" and config.head_size == 16
    kind = model.config.model_type
    assert config.norm_position == ("pre" if kind == "gemma" else "both")
    assert config.qk_norm == ("head" if kind == "gemma3_text" else "none")
    # the per-layer pattern as transformers derives it (Gemma 2 alternates, Gemma 3 has every 6th global)
    assert config.layer_types == (None if kind == "gemma" else tuple(model.config.layer_types))
    assert config.rope_local_base_freq == (100.0 if kind == "gemma3_text" else None)


@pytest.mark.parametrize("built", ["gemma2"], indirect=True)
def test_the_soft_caps_clip(built):
    """Without its caps the same model gives other logits: the caps are in their tanh's bend."""
    _, model, ref = built
    with torch.no_grad():
        model.config.final_logit_softcapping = None
        raw = hf_logits(model, TOKENS)
        assert np.abs(raw).max() > 1.0  # would exceed the final cap twice over
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = hf_logits(model, TOKENS)
        model.config.final_logit_softcapping = 0.5
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = 1.0
    np.testing.assert_allclose(hf_logits(model, TOKENS), ref, atol=0, rtol=0)  # restored
    assert np.abs(np.tanh(uncapped / 0.5) * 0.5 - ref).max() > 0.05  # the attention cap matters


def test_logits_match_on_one_device(built):
    path, _, ref = built
    module, _, params = load_hf(path)
    out = apply(module, params, make_mesh("", devices=jax.devices()[:1]))
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("built", ["gemma2", "gemma3"], indirect=True)  # each holds Gemma's components too
def test_logits_match_under_fsdp_tp_on_8_devices(built):
    path, _, ref = built
    mesh, rules = make_mesh("data=2,fsdp=2,tensor=2"), get_rules("fsdp_tp")
    module, config, params = load_hf(path, mesh=mesh, rules=rules)
    stack = params["layers"]["sub_0"] if "sub_0" in params["layers"] else params["layers"]
    assert stack["attn"]["q"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(
        None, "fsdp", "tensor", None)
    np.testing.assert_allclose(apply(module, params, mesh), ref, atol=TOL, rtol=0)


def test_greedy_generate_matches_transformers(built, parity):
    """24 tokens through windows of 4: the cache's window and the global layers' full view."""
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    """From the scanned tree (an unrolled one exports in test_hf_models, every family there)."""
    path, model, ref = built
    _, _, config, params = parity.load(path)
    export_hf(config, params, str(tmp_path))
    back = parity.export_matches(tmp_path, model, TOKENS, ref, TOL)
    assert back.config.to_dict().get("layer_types") == model.config.to_dict().get("layer_types")


@pytest.mark.parametrize("built", ["gemma3"], indirect=True)
def test_import_hf_then_export_hf_on_the_command_line(built, tmp_path):
    """import-hf records the family; export-hf of that checkpoint (the scanned pattern layout)
    loads in transformers as the same model. (train --init-from reads an import through the
    same load_hf as the sharded test above: tests/hf/test_hf_families.py runs it.)"""
    path, model, ref = built
    imported, out = str(tmp_path / "imported"), str(tmp_path / "out")
    assert cli.main(["import-hf", path, imported]) == 0
    assert read_meta(*resolve_checkpoint(imported))["family"] == "gemma3_text"
    assert cli.main(["export-hf", imported, out]) == 0
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["model_type"] == "gemma3_text"
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(back) is type(model)
    np.testing.assert_allclose(hf_logits(back, TOKENS), ref, atol=TOL, rtol=0)


def test_an_irregular_layer_pattern_imports_scanned_and_matches_transformers(tmp_path):
    """A layer_types list no period describes (sliding, full, full, sliding) is a valid HF
    config: it imports with scanning on (an unrolled prefix or rest around the scanned run) and
    gives transformers' logits, scanned and unrolled alike."""
    hf_config = CONFIGS["gemma2"]()
    hf_config.layer_types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    path, _, ref = saved(randomized(hf_config, 1, draw), tmp_path)
    mesh, rules = one_device(), get_rules("fsdp")
    for scan in (True, False):
        module, config, params = load_hf(path, mesh=mesh, rules=rules, scan_layers=scan)
        assert config.layer_types == tuple(hf_config.layer_types)
        np.testing.assert_allclose(apply(module, params, mesh), ref, atol=TOL, rtol=0)
