"""Cohere 2 and StableLM against transformers.

Cohere 2 (Command R7B): Cohere's parallel layer (one LayerNorm without bias, interleaved rotary,
``logit_scale``) with sliding layers that rotate and full layers without positions (NoPE); the
pattern from ``sliding_window_pattern`` when config.json has no ``layer_types`` (as published).
StableLM: LayerNorms with bias, rotary on part of each head, q/k/v biases, a LayerNorm of each
query and key head (a weight per head, no bias: the ``qk_norm_no_bias`` feature), and the
parallel residual from one input LayerNorm on or off.

Tiny random HF models with every mechanism on (windows of 4 in a text of 16, full NoPE layers
between sliding ones): logits equal transformers' on one device (StableLM's under fsdp_tp on 8 devices too),
greedy tokens equal, export then ``from_pretrained`` equal; each mechanism changes transformers'
logits (or, where transformers' config cannot switch it alone, shardzoo's without it differ from
transformers'). Tolerance: 1e-4 on float32 logits, as for every family.
"""

import os
import sys

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Cohere2Config, StableLmConfig

from shardzoo.models.arch import FULL, SLIDING
from shardzoo.models.hf import HFError, config_to_hf, export_hf, load_hf_config
from shardzoo.models.hf.registry import PRESETS
from shardzoo.models.transformer import Transformer
from shardzoo.sharding import get_rules
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOKENS,
    TOL,
    apply,
    fsdp_tp_parity,
    hf_logits,
    one_device,
    randomized,
    rewritten,
    saved,
    stacked_q,
)

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
S, F = SLIDING, FULL
STABLELM = dict(DIMS, num_hidden_layers=2, use_qkv_bias=True, qk_layernorm=True, partial_rotary_factor=0.5,
                rope_theta=1000.0)
CONFIGS = {
    # sliding (rotary), full (NoPE), twice: a scanned period of 2; biases on q/k/v/o, a logit scale
    "cohere2": lambda: Cohere2Config(**DIMS, num_hidden_layers=4, sliding_window=4, sliding_window_pattern=2,
                                     attention_bias=True, logit_scale=0.3),
    "stablelm": lambda: StableLmConfig(**STABLELM),
    "stablelm_parallel": lambda: StableLmConfig(**STABLELM, use_parallel_residual=True),
}
SEEDS = {"cohere2": 3, "stablelm": 9, "stablelm_parallel": 1}  # each with a varied greedy continuation


def edited(model, **changes):
    """transformers' model of ``model``'s config with ``changes``, holding its weights (those it has)."""
    config = type(model.config)(**(model.config.to_dict() | changes))
    other = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    other.load_state_dict(model.state_dict(), strict=False)
    return other


def _build(name, tmp_path_factory):
    """(name, HF dir, HF model, reference logits): every weight random, norm scales near 1."""
    return name, *saved(randomized(CONFIGS[name](), SEEDS[name]), tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family's tiny model, built once for the module, when a test first asks for it."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _build(name, tmp_path_factory)
        return cache[name]

    return get


@pytest.fixture(params=list(CONFIGS))
def built(request, models):
    return models(request.param)


def test_config_reads_the_mechanisms(built):
    name, path, _, _ = built
    config = load_hf_config(path)
    if name == "cohere2":
        assert config.layer_types == (S, F, S, F) and config.sliding_window == 4
        assert config.rope_layers == (True, False, True, False)
        assert [s.rope for s in config.layer_specs()] == ["global", "none"] * 2
        assert config.block_form == "parallel" and config.rope_interleaved and config.logit_scale == 0.3
        assert (config.norm_type, config.qk_norm, config.head_dim) == ("layernorm_no_bias", "none", None)
        assert config.attention_bias and config.attention_out_bias and config.tie_word_embeddings
    else:
        assert (config.norm_type, config.qk_norm, config.qk_norm_no_bias) == ("layernorm", "heads", True)
        assert config.partial_rotary_factor == 0.5 and config.rope_theta == 1000.0
        assert config.attention_bias and not config.attention_out_bias and not config.mlp_bias
        assert (config.block_form == "parallel") == (name == "stablelm_parallel")


def test_each_mechanism_changes_transformers_logits(built):
    """The same weights without a mechanism compute other logits in transformers (config edits),
    or, where its config cannot switch the mechanism alone, in shardzoo: parity below can fail."""
    name, path, model, ref = built
    if name == "cohere2":
        edits = [dict(sliding_window=16),  # windows as long as the text: the window mattered
                 dict(logit_scale=1.0)]
    else:
        whole = dict(model.config.rope_parameters, partial_rotary_factor=1.0)
        edits = [dict(rope_parameters=whole), dict(qk_layernorm=False), dict(use_qkv_bias=False),
                 dict(use_parallel_residual=name != "stablelm_parallel")]
    for change in edits:
        assert np.abs(hf_logits(edited(model, **change), TOKENS) - ref).max() > 1e-2, change
    mesh = one_device()
    module, config, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp"))
    np.testing.assert_allclose(apply(module, params, mesh), ref, atol=TOL, rtol=0)
    if name == "cohere2":  # rotary on the full layers too; rotate-half pairs
        for change in (dict(rope_layers=None), dict(rope_interleaved=False)):
            got = apply(Transformer(config.replace(**change)), params, mesh)
            assert np.abs(got - ref).max() > 1e-2, change


# under fsdp_tp: StableLM's head LayerNorm with a weight per head; Cohere 2 and the parallel StableLM
# recombine components sharded elsewhere (the parallel layer: test_hf_cohere, test_hf_phi; windows:
# test_hf_models' mistral_window; NoPE layers: test_hf_olmo3_smollm3_ministral's smollm3), and
# their one-device parity is the check above
@pytest.mark.parametrize("built", ["stablelm"], indirect=True)
def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    name, path, _, ref = built
    single, got = fsdp_tp_parity(path, ref, q=stacked_q)
    print(f"{name}: max |logit diff| on one device {np.abs(single - ref).max():.2e}, "
          f"under fsdp_tp {np.abs(got - ref).max():.2e}")


def test_greedy_generate_matches_transformers(built, parity):
    _, path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    name, path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["model_type"] == model.config.model_type
    if name == "cohere2":
        assert hf["layer_types"] == [S, F, S, F] and hf["logit_scale"] == 0.3
    else:
        assert hf["qk_layernorm"] is True and hf["partial_rotary_factor"] == 0.5
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_cohere2_pattern_from_sliding_window_pattern_and_every_layer_full(models, tmp_path):
    """The published config.json's form (``sliding_window_pattern``, no ``layer_types``) reads as
    transformers reads it; every layer full: none rotates (in transformers too); no window, or a
    pattern that is not a period, is refused by name (transformers' Cohere 2 fails without one)."""
    _, path, model, ref = models("cohere2")
    published = rewritten(path, tmp_path / "published", ["layer_types"], sliding_window_pattern=2)
    assert AutoConfig.from_pretrained(published).layer_types == [S, F, S, F]
    assert load_hf_config(published) == load_hf_config(path)
    full = load_hf_config(rewritten(path, tmp_path / "full", layer_types=[F] * 4))
    assert full.sliding_window is None and full.layer_types is None and full.rope_layers == (False,) * 4
    mesh = one_device()
    module, _, params = load_hf(str(tmp_path / "full"), mesh=mesh, rules=get_rules("fsdp"))
    want = hf_logits(edited(model, layer_types=[F] * 4), TOKENS)
    assert np.abs(want - ref).max() > 1e-2
    np.testing.assert_allclose(apply(module, params, mesh), want, atol=TOL, rtol=0)
    assert config_to_hf(full)["model_type"] == "cohere2"  # with a window no layer uses
    with pytest.raises(HFError, match="sliding_window=None"):
        load_hf_config(rewritten(path, tmp_path / "no_window", sliding_window=None))
    with pytest.raises(HFError, match="sliding_window_pattern=0"):
        load_hf_config(rewritten(path, tmp_path / "bad", ["layer_types"], sliding_window_pattern=0))


def test_nope_layers_other_than_the_full_ones_do_not_export_as_cohere2(models):
    _, path, _, _ = models("cohere2")
    config = load_hf_config(path).replace(rope_layers=None)  # the full layers rotating too
    with pytest.raises(HFError, match="rope_layers"):
        config_to_hf(config, family="cohere2")


@pytest.mark.parametrize("name, model_type", [("command-r7b", "cohere2"), ("cohere2-tiny", "cohere2"),
                                              ("stablelm-tiny", "stablelm")])
def test_presets_have_transformers_parameter_count(name, model_type):
    config = PRESETS[name]
    hf = config_to_hf(config)
    assert hf["model_type"] == model_type
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    if name == "command-r7b":  # 3 sliding layers with rotary embeddings, then a full one without
        assert [s.rope for s in config.layer_specs()[:4]] == ["global"] * 3 + ["none"]
        assert model.config.layer_types[:4] == [S, S, S, F] and config.num_params() == 8_028_033_024


def test_stablelm_without_a_rotary_fraction_rotates_a_quarter_as_transformers(models, tmp_path):
    _, path, _, _ = models("stablelm")
    bare = rewritten(path, tmp_path / "bare", ["rope_parameters"], rope_theta=1000.0)
    assert AutoConfig.from_pretrained(bare).rope_parameters["partial_rotary_factor"] == 0.25
    config = load_hf_config(bare)
    assert config.partial_rotary_factor == 0.25 and config.rope_theta == 1000.0
