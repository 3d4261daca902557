"""Granite and Granite-MoE, the first families written on the family layer: Llama's (and
Mixtral's) layout with four multipliers (embedding, residual, attention and logits), a feature
written once in the shared layers.

Tiny random HF models whose multipliers are far from 1: logits equal transformers' on one device
(Granite's under fsdp_tp on 8 devices too), greedy tokens equal, export then
``from_pretrained`` equal. Tolerance: 1e-4 on float32 logits, as for every family.
"""

import os
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GraniteConfig, GraniteMoeConfig

from shardzoo.models.hf import HFError, config_to_hf, export_hf, load_hf_config
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOKENS,
    TOL,
    apply,
    config_of,
    fsdp_tp_parity,
    hf_logits,
    one_device,
    randomized,
    saved,
)

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
MULTIPLIERS = dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.3,
                   logits_scaling=2.5)
CONFIGS = {
    "granite": lambda: GraniteConfig(**DIMS, **MULTIPLIERS),
    # every expert slot used: capacity in shardzoo's dispatch is an execution choice; HF drops nothing
    "granitemoe": lambda: GraniteMoeConfig(**DIMS, **MULTIPLIERS, num_local_experts=4, num_experts_per_tok=2),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random, norm scales near 1."""
    model = randomized(CONFIGS[request.param](), seed=0)
    return saved(model, tmp_path_factory.mktemp(request.param))


def test_the_multipliers_matter(built):
    """With any one multiplier at 1 transformers gives other logits: a family that dropped it
    could not pass the parity tests below."""
    path, model, ref = built
    for name in MULTIPLIERS:
        with torch.no_grad():
            saved = getattr(model.config, name)
            setattr(model.config, name, 1.0)
            other = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").eval()
            other.load_state_dict(model.state_dict())
            changed = hf_logits(other, TOKENS)  # (the logits scaling is read from the config here)
            setattr(model.config, name, saved)
        assert np.abs(changed - ref).max() > 1e-2, name
    config = load_hf_config(path)
    assert (config.embedding_multiplier, config.residual_multiplier, config.attention_scale,
            config.logits_scaling) == (4.0, 0.5, 0.3, 2.5)


@pytest.mark.parametrize("built", ["granite"], indirect=True)
def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    """The multipliers under fsdp_tp, once: Granite-MoE adds Mixtral's experts to them (under
    fsdp_tp: test_hf_models' mixtral; under ep, the default dispatch: test_hf_famC's Phi-MoE)."""
    path, _, ref = built
    fsdp_tp_parity(path, ref)


@pytest.mark.parametrize("built", ["granitemoe"], indirect=True)
def test_moe_logits_match_on_one_device(built):
    path, _, ref = built
    module, _, params = load_hf(path, mesh=one_device())
    np.testing.assert_allclose(apply(module, params, one_device()), ref, atol=TOL, rtol=0)


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["model_type"] == model.config.model_type and hf["attention_multiplier"] == 0.3
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_a_family_without_the_feature_refuses_to_export_it():
    """Llama's config.json has no multipliers: exporting a Granite model as Llama names the
    feature and its fields, and is never written without them."""
    config = config_of(GraniteConfig(**DIMS, **MULTIPLIERS))
    with pytest.raises(HFError, match=r"llama cannot express feature multipliers \(embedding_multiplier=4.0, "
                                      r"residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.5\)"):
        config_to_hf(config, family="llama")
    assert config_to_hf(config)["model_type"] == "granite"  # the first family that expresses it
    plain = config.replace(embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0,
                           attention_multiplier=None)
    assert config_to_hf(plain)["model_type"] == "llama"  # multipliers of 1: Llama's own math


# ibm-granite/granite-4.0-h-tiny/config.json's sizes and layer_types as published; multipliers, rms_norm_eps and
# special tokens as its GGUF conversion carries them (position_embedding_type absent: NoPE)
GRANITE_4_H_TINY = dict(
    model_type="granitemoehybrid", architectures=["GraniteMoeHybridForCausalLM"], vocab_size=100352, hidden_size=1536,
    num_hidden_layers=40, num_attention_heads=12, num_key_value_heads=4, intermediate_size=512,
    shared_intermediate_size=1024, num_local_experts=64, num_experts_per_tok=6, tie_word_embeddings=True,
    mamba_d_state=128, mamba_n_groups=1, mamba_n_heads=48, mamba_d_head=64, mamba_expand=2, mamba_d_conv=4,
    mamba_chunk_size=256, max_position_embeddings=131072, rms_norm_eps=1e-5, embedding_multiplier=12.0,
    residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=6.0, bos_token_id=100257,
    eos_token_id=100257, layer_types=(["mamba"] * 5 + ["attention"] + (["mamba"] * 9 + ["attention"]) * 3
                                      + ["mamba"] * 4))


def test_the_published_granite_4_h_tiny_config_reads_as_its_preset():
    """The preset is what the published config.json reads as (its count: test_hf_families' preset test)."""
    from shardzoo.models.hf.registry import PRESETS

    assert config_of(GRANITE_4_H_TINY).arch == PRESETS["granite-4.0-h-tiny"].arch
