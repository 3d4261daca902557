"""Gemma 4 (text): Gemma 3's layers with the full-attention layers shaped apart (their own head size and
key/value heads, keys serving as values: models/attention.py ``GlobalAttention``), proportional rotary on
them (models/rope.py), values RMS-normalised without a weight (``v_norm``), every layer's output times its
scalar (``layer_scalar``), plain RMSNorms and an attention scale of 1; the MoE block beside every MLP
(models/moe.py ``DENSE_AND_MOE_KIND``, the ``scaled_softmax`` router); and the text model of a multimodal
``gemma4`` checkpoint.

A tiny random HF model (sliding, full, sliding, full: two scanned periods; a window of 4 in 16 tokens):
logits equal transformers' on one device and under fsdp_tp on 8 devices, greedy tokens equal over 16,
export then ``from_pretrained`` equal; each new mechanism moves the logits; the MoE block the same, under
ep (expert=4, data=2) for its sharded check. Tolerance: 1e-4 on float32 logits, as for every family.
"""

import copy
import json
import os
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma4Config, Gemma4TextConfig

from shardzoo.models import ModelError
from shardzoo.models.arch import arch_of
from shardzoo.models.hf import HFError, export_hf, load_hf_config
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOKENS,
    TOL,
    apply,
    fsdp_tp_parity,
    hf_logits,
    load_ep,
    near_one,
    one_device,
    randomize,
    randomized,
    rewritten,
    saved,
)

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, bos_token_id=None, eos_token_id=None, pad_token_id=None)
SWA, FULL = "sliding_attention", "full_attention"
# sliding layers: heads of 8, 4 kv heads; full layers: heads of 16, 2 kv heads whose keys are the values
GEMMA4 = dict(head_dim=8, global_head_dim=16, num_global_key_value_heads=2, attention_k_eq_v=True,
              hidden_size_per_layer_input=0, sliding_window=4, layer_types=[SWA, FULL, SWA, FULL],
              final_logit_softcapping=3.0)
# the MoE block beside every layer's MLP: 4 experts top-2 by the scaled router
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)
CONFIGS = {"gemma4_text": lambda: Gemma4TextConfig(**DIMS, **GEMMA4),
           "gemma4_text_moe": lambda: Gemma4TextConfig(**DIMS, **(GEMMA4 | MOE))}


def layer_scalars(name, b):
    """A draw for ``randomize``'s buffers: each layer's scalar away from 1."""
    return 1 + 0.3 * torch.randn_like(b) if name.endswith("layer_scalar") else None


def moe_draw(name, p):
    """``near_one``, and the router's input scale and per-expert scales near 1 too."""
    return 1 + 0.3 * torch.randn_like(p) if name.endswith(("router.scale", "per_expert_scale")) else near_one()(name, p)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random, norm scales and layer scalars near 1."""
    model = randomized(CONFIGS["gemma4_text"](), 1, near_one(), layer_scalars)  # seed 1: a varied greedy text
    return saved(model, tmp_path_factory.mktemp("gemma4_text"))


def test_the_config_reads_every_mechanism_and_each_matters(built):
    """The import reads the global layers' shape, the rotary, the norms and the scalars; each
    mechanism transformers can switch moves its logits, and each shardzoo can switch moves
    shardzoo's (so parity below tests it)."""
    path, model, ref = built
    config = load_hf_config(path)
    a = config.arch
    assert (a.global_attention.head_dim, a.global_attention.num_key_value_heads, a.global_attention.k_eq_v) == (
        16, 2, True)
    assert a.rope_scaling_dict == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert (a.norm_type, a.v_norm, a.layer_scalar, a.attention_scale) == ("rmsnorm", True, True, 1.0)
    assert config.num_params() == sum(p.numel() for p in model.parameters())  # the scalars are buffers
    assert [s.window for s in config.layer_specs()] == [4, None, 4, None]
    assert config.layout().period == 2 and config.layout().repeats == 2  # scanned: two periods
    # transformers: default rotary on the full layers; the layer scalars at 1; values of their own
    other = AutoModelForCausalLM.from_config(Gemma4TextConfig(**DIMS, **(GEMMA4 | dict(rope_parameters={
        FULL: {"rope_type": "default", "rope_theta": 1e6}, SWA: {"rope_type": "default", "rope_theta": 1e4}}))),
        attn_implementation="eager").eval()
    other.load_state_dict(model.state_dict())
    assert np.abs(hf_logits(other) - ref).max() > 1e-3
    unscaled = copy.deepcopy(model)
    for layer in unscaled.model.layers:
        layer.layer_scalar.fill_(1.0)
    assert np.abs(hf_logits(unscaled) - ref).max() > 1e-3
    own_values = copy.deepcopy(model)
    attn = own_values.model.layers[1].self_attn
    attn.v_proj = torch.nn.Linear(32, 2 * 16, bias=False)
    assert np.abs(hf_logits(own_values) - ref).max() > 1e-3
    # shardzoo: without the value norm
    module, _, params = load_hf(path, mesh=one_device(), overrides=dict(v_norm=False))
    assert np.abs(apply(module, params, one_device()) - ref).max() > 1e-3


def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    """The global layers' kernels (their own head size and kv heads, no v) shard as the others."""
    path, _, ref = built
    fsdp_tp_parity(path, ref)


def test_greedy_generate_matches_transformers(built, parity):
    """Prompt 8, 16 new tokens from the cache (the global layers' wider keys and values)."""
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["model_type"] == "gemma4_text" and hf["per_layer_config"]["1"] == {"head_dim": 16,
                                                                                 "num_key_value_heads": 2}
    parity.export_matches(str(tmp_path), model, TOKENS, ref, TOL)


@pytest.fixture(scope="module")
def built_moe(tmp_path_factory):
    model = randomized(CONFIGS["gemma4_text_moe"](), 1, moe_draw, layer_scalars)
    return saved(model, tmp_path_factory.mktemp("gemma4_text_moe"))


def test_the_moe_block_reads_and_its_router_scales_matter(built_moe):
    """Every layer a dense MLP and 4 experts side by side (models/moe.py DENSE_AND_MOE_KIND), the
    scaled_softmax router; its input scale and per-expert scales each move transformers' logits."""
    path, model, ref = built_moe
    config = load_hf_config(path)
    a = config.arch
    assert (a.mlp_layer_types, a.moe.router_kind, a.moe.num_local_experts, a.expert_size) == (
        ("dense_and_moe",) * 4, "scaled_softmax", 4, 16)
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    for scale in ("scale", "per_expert_scale"):
        other = copy.deepcopy(model)
        for layer in other.model.layers:
            getattr(layer.router, scale).data.fill_(1.0)
        assert np.abs(hf_logits(other) - ref).max() > 1e-3, scale


def test_the_moe_block_matches_on_one_device_and_under_ep(built_moe):
    """One device, then expert-parallel on 8 devices (expert=4, data=2): an expert a device."""
    path, _, ref = built_moe
    module, _, params = load_hf(path, mesh=one_device())
    np.testing.assert_allclose(apply(module, params, one_device()), ref, atol=TOL, rtol=0)
    module, _, params, mesh = load_ep(path)
    assert params["layers"]["sub_0"]["moe"]["wi_gate"].addressable_shards[0].data.shape[:2] == (2, 1)
    np.testing.assert_allclose(apply(module, params, mesh), ref, atol=TOL, rtol=0)


def test_the_moe_block_generates_and_exports(built_moe, tmp_path, parity):
    path, model, ref = built_moe
    parity.greedy_matches(path, model, TOKENS[:1, :8])
    _, _, config, params = parity.load(path)
    assert export_hf(config, params, str(tmp_path))["enable_moe_block"] is True
    parity.export_matches(str(tmp_path), model, TOKENS, ref, TOL)


@pytest.mark.parametrize("change, field", [
    (MOE | dict(hidden_size_per_layer_input=4), "enable_moe_block"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
])
def test_what_gemma4_adds_beyond_this_is_refused_naming_the_field(change, field, tmp_path):
    """The MoE block beside per-layer inputs (tests/hf/test_hf_gemma3n.py runs those without),
    bidirectional attention."""
    path = rewritten(Gemma4TextConfig(**DIMS, **(GEMMA4 | change)), tmp_path)
    with pytest.raises(HFError, match=field) as e:
        load_hf_config(path)
    assert "\n" not in str(e.value)


def test_a_config_without_hidden_size_per_layer_input_has_transformers_per_layer_inputs(tmp_path):
    """transformers' default is 256 per-layer input features: a config.json without the key reads them."""
    path = rewritten(Gemma4TextConfig(**DIMS, **GEMMA4), tmp_path, drop=("hidden_size_per_layer_input",))
    assert load_hf_config(path).arch.per_layer.input_size == 256


def test_the_published_layout_reads_global_head_dim_and_kv_heads(tmp_path):
    """A published config.json spells the global layers' shape ``global_head_dim`` and
    ``num_global_key_value_heads`` (no per_layer_config): read the same, and the kv heads only
    with attention_k_eq_v, as transformers does."""
    base = Gemma4TextConfig(**DIMS, **GEMMA4).to_dict()
    published = {k: v for k, v in base.items() if k != "per_layer_config"} | dict(
        global_head_dim=16, num_global_key_value_heads=2)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps(published))
    assert load_hf_config(str(tmp_path / "a")).arch.global_attention.num_key_value_heads == 2
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps(published | dict(attention_k_eq_v=False)))
    g = load_hf_config(str(tmp_path / "b")).arch.global_attention
    assert (g.head_dim, g.num_key_value_heads, g.k_eq_v) == (16, None, False)


@pytest.mark.parametrize("per_layer", [{"1": {"head_dim": 16}}, {"full_attention": {"head_dim": 16}},
                                       {"1": {"head_dim": 16, "sliding_window": 2}, "3": {"head_dim": 16}}])
def test_a_per_layer_config_other_than_one_shape_of_the_full_layers_is_refused(per_layer, tmp_path):
    """Only the full layers, all alike, by index, with head_dim and num_key_value_heads."""
    path = rewritten(Gemma4TextConfig(**DIMS, **GEMMA4), tmp_path, per_layer_config=per_layer)
    with pytest.raises(HFError, match="per_layer_config"):
        load_hf_config(path)


def test_global_attention_settings_are_checked_by_name():
    with pytest.raises(ModelError, match="num_global_key_value_heads=3"):
        arch_of(num_attention_heads=4, hidden_size=32, num_global_key_value_heads=3)
    with pytest.raises(ModelError, match="latent attention"):
        arch_of(num_attention_heads=4, hidden_size=32, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                v_head_dim=4, global_head_dim=16)


def test_the_text_model_of_a_multimodal_gemma4_checkpoint(tmp_path, capfd):
    """A tiny ``gemma4`` checkpoint (a one-layer vision tower around the text model) imports as its
    ``gemma4_text`` model, saying the vision tower is left out: its logits on text within 1e-4 of
    the conditional-generation model's; it exports as ``gemma4_text``, which transformers loads
    with those logits."""
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64)
    text = CONFIGS["gemma4_text"]().to_dict() | dict(pad_token_id=0)  # the multimodal model masks media by it
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    torch.manual_seed(0)
    from transformers import AutoModelForImageTextToText

    model = randomize(AutoModelForImageTextToText.from_config(config, attn_implementation="eager").eval(),
                      near_one(), layer_scalars)
    assert type(model).__name__ == "Gemma4ForConditionalGeneration"
    path, _, ref = saved(model, tmp_path / "gemma4")
    module, loaded, params = load_hf(path, mesh=one_device())
    assert "left out" in capfd.readouterr().err
    np.testing.assert_allclose(apply(module, params, one_device()), ref, atol=TOL, rtol=0)
    assert export_hf(loaded, params, str(tmp_path / "text"))["model_type"] == "gemma4_text"
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "text", attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(back), ref, atol=TOL, rtol=0)
