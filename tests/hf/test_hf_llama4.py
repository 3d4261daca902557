"""Llama 4 text: chunked attention on the rotary layers (chunks of 4, shorter than the 16-token
rows), a NoPE layer with the attention temperature (floor_scale 4, so it varies within a row),
the weightless L2 qk-norm, interleaved (complex-pair) rotary embeddings, and MoE every 2nd
layer: 4 experts, a top-1 sigmoid router scaling the expert's input, and a shared expert.

A tiny random HF model: logits equal transformers' on one device, under fsdp_tp and under ep on
8 devices, greedy tokens equal over 16 new ones (decoding from the cache: its chunks), export
then ``from_pretrained`` equal; a ``llama4`` (multimodal) directory's text part gives the same
logits. Tolerance: 1e-4 on float32 logits, as for every family.
"""

import os
import sys

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Llama4Config,
    Llama4ForConditionalGeneration,
    Llama4TextConfig,
)

from shardzoo.models import ModelError
from shardzoo.models.hf import export_hf, load_hf_config
from shardzoo.models.hf.registry import PRESETS
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOKENS,
    TOL,
    apply,
    apply_mutable,
    hf_logits,
    load_ep,
    near_one,
    one_device,
    randomized,
    saved,
)

E = 4
# layers 0-2 rotary and chunked by 4, layer 3 NoPE (full attention, temperature-tuned); MoE on 1 and 3
HF_CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=16, intermediate_size_mlp=48,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 num_local_experts=E, num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=4,
                 no_rope_layers=[1, 1, 1, 0], use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4,
                 attn_scale=0.5, max_position_embeddings=64, rope_parameters=dict(rope_type="default", rope_theta=100.0),
                 bos_token_id=None, eos_token_id=None, pad_token_id=None)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14, vision_output_dim=16, projector_input_dim=16, projector_output_dim=32)


DRAW = near_one(std=0.2)  # every weight random, norm scales near 1


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random, norm scales near 1."""
    return saved(randomized(Llama4TextConfig(**HF_CONFIG), seed=3, draw=DRAW), tmp_path_factory.mktemp("llama4"))


def test_the_config_reads_every_mechanism_and_each_matters(built):
    """Each mechanism changes transformers' logits (so parity below tests it), and the import
    reads it into the layer specs."""
    path, model, ref = built
    config = load_hf_config(path)
    specs = config.layer_specs()
    assert [s.chunk for s in specs] == [4, 4, 4, None]
    assert [s.rope for s in specs] == ["global", "global", "global", "none"]
    assert [s.mlp for s in specs] == ["dense", "moe", "dense", "moe"]
    a = config.arch
    assert (a.qk_norm, a.moe.router_kind, a.rope_interleaved, a.attn_temperature_tuning.floor_scale) == (
        "l2", "sigmoid_input", True, 4.0)
    assert (a.intermediate_size, a.expert_size, a.moe.shared_expert_intermediate_size) == (48, 16, 16)
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    for change in (dict(attention_chunk_size=None), dict(attn_temperature_tuning=False), dict(use_qk_norm=False)):
        other = AutoModelForCausalLM.from_config(Llama4TextConfig(**(HF_CONFIG | change)),
                                                 attn_implementation="eager").eval()
        other.load_state_dict(model.state_dict())
        assert np.abs(hf_logits(other, TOKENS) - ref).max() > 1e-3, change


def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    path, _, ref = built
    one = one_device()
    module, _, params = load_hf(path, mesh=one, rules=get_rules("fsdp"))
    assert params["layers_1"]["moe"]["wi_gate"].shape == (E, 32, 16)  # [expert, embed, mlp]; no period: unrolled
    got = apply(module, params, one)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    got = apply(module, params, mesh)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("dispatch", ["indexed", "capacity"])
def test_logits_match_under_ep_on_8_devices(built, dispatch):
    """The input-scaled router through the buffer dispatches (a slot for every token: HF drops none)."""
    path, _, ref = built
    module, _, params, mesh = load_ep(path, moe_dispatch=dispatch, capacity_factor=float(E))
    assert params["layers_1"]["moe"]["wi_gate"].addressable_shards[0].data.shape[0] == 1  # 4 ways
    got, state = apply_mutable(module, params, mesh, ["metrics"])
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    assert float(np.max(state["metrics"]["layers_1"]["moe"]["dropped_fraction"][0])) == pytest.approx(0)


def test_greedy_generate_matches_transformers(built, parity):
    """Prompt 6, 16 new tokens: decoding crosses several chunk boundaries from the cache."""
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :6])


def test_export_round_trip_loads_the_same_model(built, parity, tmp_path):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert (hf["model_type"], hf["moe_layers"], hf["no_rope_layers"]) == ("llama4_text", [1, 3], [1, 1, 1, 0])
    parity.export_matches(str(tmp_path), model, TOKENS, ref, TOL)


def test_a_llama4_directory_imports_its_text_part(built, tmp_path):
    """Llama4ForConditionalGeneration's config.json (text_config + vision_config) and its
    tensors under ``language_model.``: the same text model, the same logits."""
    path, model, ref = built
    full = Llama4ForConditionalGeneration(Llama4Config(text_config=HF_CONFIG, vision_config=VISION)).eval()
    full.language_model.load_state_dict(model.state_dict())
    full.save_pretrained(tmp_path)
    assert load_hf_config(str(tmp_path)).arch == load_hf_config(path).arch
    one = one_device()
    module, _, params = load_hf(str(tmp_path), mesh=one, rules=get_rules("fsdp"))
    got = apply(module, params, one)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


def test_the_chunked_mask_in_one_pass_and_from_the_cache():
    """A query sees the keys of its own chunk up to itself: in one pass (slots = positions) and
    when decoding at cache index 5 over a cache of 8 slots."""
    from shardzoo.models.attention_kernels import attention_mask

    slots = np.arange(8)[None]
    m = np.asarray(attention_mask(slots, slots, None, None, None, 4))[0, 0]
    assert m[3].tolist() == [True] * 4 + [False] * 4
    assert m[5].tolist() == [False] * 4 + [True, True] + [False] * 2
    step = np.asarray(attention_mask(np.array([[5]]), slots, np.ones((1, 1)), np.ones((1, 8)), None, 4))[0, 0, 0]
    assert step.tolist() == m[5].tolist()


def test_presets_count_as_transformers(tmp_path):
    """llama-4-scout-17b-16e: 107,769,861,120 parameters, transformers' count of Llama4ForCausalLM
    on the published text_config (built on the meta device)."""
    scout = PRESETS["llama-4-scout-17b-16e"]
    hf = Llama4TextConfig(vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                          num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                          num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1,
                          attention_chunk_size=8192, use_qk_norm=True)
    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
    assert scout.num_params() == count == 107_769_861_120
    tiny = PRESETS["llama4-tiny"]
    assert [s.chunk for s in tiny.layer_specs()] == [4, 4, 4, None]


def test_eight_layers_scan_as_two_periods_and_match(tmp_path):
    """transformers' defaults for the pattern (NoPE every 4th layer, MoE every 2nd): a period of
    four layers, scanned twice, with the same logits."""
    hf_config = dict(HF_CONFIG, num_hidden_layers=8, no_rope_layers=None)
    path, model, ref = saved(randomized(Llama4TextConfig(**hf_config), seed=4, draw=DRAW), tmp_path)
    config = load_hf_config(path)
    assert config.layout().as_tuple() == (0, 4, 2)
    one = one_device()
    module, _, params = load_hf(path, mesh=one, rules=get_rules("fsdp"))
    assert params["layers"]["sub_3"]["moe"]["wi_up"].shape == (2, E, 32, 16)  # [layers, expert, embed, mlp]
    got = apply(module, params, one)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("fields, message", [
    (dict(layer_types=("chunked_attention",) * 4, attention_chunk_size=None), "attention_chunk_size is not set"),
    (dict(attention_chunk_size=0), "attention_chunk_size"),
    (dict(sliding_window=8, layer_types=None), "say which layers are which"),
    (dict(floor_scale=0.0), "floor_scale"),
])
def test_bad_chunk_and_temperature_settings_are_refused_by_name(fields, message):
    with pytest.raises(ModelError, match=message):
        PRESETS["llama4-tiny"].replace(**fields)


def test_scouts_llama3_rope_without_a_band_equals_transformers():
    """Scout's rope_scaling has low_freq_factor == high_freq_factor: no smoothed band, no division
    by zero; the inverse frequencies equal transformers' (float32, 1e-7)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from shardzoo.models.rope import rope_inv_freq

    with np.errstate(all="raise"):
        ours = rope_inv_freq(PRESETS["llama-4-scout-17b-16e"].arch)
    hf = Llama4TextConfig(max_position_embeddings=10485760, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
        original_max_position_embeddings=8192))
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    np.testing.assert_allclose(ours, want.numpy(), rtol=0, atol=1e-7)


def test_cudnn_attention_cannot_chunk():
    with pytest.raises(ModelError, match="attention_impl='cudnn' cannot mask chunks"):
        PRESETS["llama4-tiny"].replace(attention_impl="cudnn")
