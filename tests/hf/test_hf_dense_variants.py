"""Arcee, EXAONE 4, HunYuan dense and Seed-OSS: Llama's layout with one or two mechanisms each.

Arcee: a plain MLP with the squared ReLU (``relu2``). EXAONE 4: post-norms, qk-norm of each
head, sliding and full layers, and no rotary embedding on the full ones (``rope_layers`` false there).
HunYuan: qk-norm of each head after the rotary embedding (``qk_norm_after_rope``). Seed-OSS:
q/k/v, o and MLP biases on their own flags.

Tiny random HF models with those mechanisms on (windows shorter than the 16 tokens, biases
random): logits equal transformers' on one device (and under fsdp_tp on 8 devices where a family carries a
component of its own), greedy tokens
equal, export then ``from_pretrained`` equal, and each mechanism changes transformers' logits.
Tolerance: 1e-4 on float32 logits, as for every family.
"""

import os
import sys

import numpy as np
import pytest
import torch
from transformers import (
    ArceeConfig,
    AutoModelForCausalLM,
    Exaone4Config,
    HunYuanDenseV1Config,
    Qwen3Config,
    SeedOssConfig,
)

from shardzoo.models.hf import HFError, config_to_hf, export_hf, family_of_config, load_hf_config
from shardzoo.models.hf.registry import PRESETS
from shardzoo.sharding import get_rules
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOKENS,
    TOL,
    apply,
    fsdp_tp_parity,
    hf_logits,
    near_one,
    one_device,
    randomize,
    rewritten,
    saved,
)

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {  # model_type -> (HF config, torch seed whose greedy continuation varies)
    "arcee": (lambda: ArceeConfig(**DIMS, attention_bias=True, mlp_bias=True), 0),
    # layers S F S F: the full ones see every token and have no rotary embedding
    "exaone4": (lambda: Exaone4Config(**(DIMS | dict(num_hidden_layers=4)), sliding_window=4,
                                      sliding_window_pattern=2), 0),
    "hunyuan_v1_dense": (lambda: HunYuanDenseV1Config(**DIMS, head_dim=8, attention_bias=True), 0),
    "seed_oss": (lambda: SeedOssConfig(**DIMS, head_dim=16, attention_bias=True, attention_out_bias=False,
                                       mlp_bias=True), 0),
}
READS = {  # model_type -> architecture fields its config reads as
    "arcee": dict(mlp_type="plain", hidden_act="relu2", attention_bias=True, attention_out_bias=True, mlp_bias=True),
    "exaone4": dict(norm_position="post", qk_norm="head", sliding_window=4,
                    layer_types=("sliding_attention", "full_attention") * 2, rope_layers=(True, False, True, False)),
    "hunyuan_v1_dense": dict(qk_norm="head", qk_norm_after_rope=True, attention_bias=True, attention_out_bias=True),
    "seed_oss": dict(attention_bias=True, attention_out_bias=False, mlp_bias=True, head_dim=16),
}
DRAW = near_one(scale_std=0.3)  # every weight random (biases too), norm scales near 1 but far enough to matter


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    """(HF dir, HF model, reference logits)."""
    make, seed = CONFIGS[request.param]
    model = randomize(AutoModelForCausalLM.from_config(make(), attn_implementation="eager").eval(), DRAW, seed=seed)
    return saved(model, tmp_path_factory.mktemp(request.param))


def test_the_config_reads_as_its_mechanisms(built):
    path, model, _ = built
    c = load_hf_config(path)
    want = READS[model.config.model_type]
    assert {k: getattr(c, k) for k in want} == want
    assert family_of_config(c).name == model.config.model_type
    assert c.num_params() == sum(p.numel() for p in model.parameters())


def test_logits_match_on_one_device(built):
    path, _, ref = built
    np.testing.assert_allclose(_shardzoo(path), ref, atol=TOL, rtol=0)


# under fsdp_tp: the families with a component of their own (arcee's biased relu2 MLP split over
# tensor; hunyuan's qk-norm after the rotary); exaone4 and seed_oss only recombine components
# sharded elsewhere (post-norms: test_hf_models' olmo2; qk-norm of each head: its qwen3; windows:
# its mistral_window; rope_layers: test_hf_olmo3_smollm3_ministral's smollm3; q/k/v biases: test_hf_models'
# qwen2_window_layers; MLP biases: arcee here)
@pytest.mark.parametrize("built", ["arcee", "hunyuan_v1_dense"], indirect=True)
def test_logits_match_under_fsdp_tp(built):
    path, _, ref = built
    fsdp_tp_parity(path, ref)


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["model_type"] == model.config.model_type
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def _like(model, **changes):
    """An HF model of ``model``'s config with ``changes``, and ``model``'s weights."""
    cfg = model.config.to_dict() | changes
    other = AutoModelForCausalLM.from_config(type(model.config)(**cfg), attn_implementation="eager").eval()
    other.load_state_dict(model.state_dict())
    return other


def _shardzoo(path, **overrides):
    module, _, params = load_hf(path, mesh=one_device(), overrides=overrides)
    return apply(module, params, one_device())


@pytest.mark.parametrize("built", ["arcee"], indirect=True)
def test_arcee_relu2_matters(built):
    """With a plain ReLU transformers gives other logits, and shardzoo told so follows it."""
    path, model, ref = built
    relu = hf_logits(_like(model, hidden_act="relu"))
    assert np.abs(relu - ref).max() > 1e-2
    np.testing.assert_allclose(_shardzoo(path, hidden_act="relu"), relu, atol=TOL, rtol=0)


@pytest.mark.parametrize("built", ["exaone4"], indirect=True)
def test_exaone4_full_layers_without_rotary_matter(built):
    """Rotating the full layers too (transformers' attention with its window attribute cleared
    on them, the mask unchanged) gives other logits; shardzoo with every layer rotating
    (``rope_layers`` null) gives those."""
    path, model, ref = built
    rotating = _like(model)
    for layer, kind in zip(rotating.model.layers, rotating.config.layer_types, strict=True):
        if kind == "full_attention":
            layer.self_attn.sliding_window = None  # transformers: rotary when no window or sliding
    every = hf_logits(rotating)
    assert np.abs(every - ref).max() > 1e-2
    np.testing.assert_allclose(_shardzoo(path, rope_layers=None), every, atol=TOL, rtol=0)


def test_exaone4_without_a_window_rotates_every_layer(tmp_path):
    Exaone4Config(**DIMS, sliding_window=None, layer_types=["full_attention"] * 2).save_pretrained(tmp_path)
    c = load_hf_config(str(tmp_path))
    assert (c.sliding_window, c.layer_types, c.rope_layers) == (None, None, None)


def test_exaone4_nope_layers_are_a_feature_other_families_refuse():
    """Qwen3 has no layers without rotary; EXAONE 4 only its full layers (those of a window)."""
    config = PRESETS["exaone4-tiny"]
    assert config.rope_layers == (True, False)
    with pytest.raises(HFError, match=r"feature nope_layers \(rope_layers=\[True, False\]\)"):
        config_to_hf(config, family="qwen3")
    with pytest.raises(HFError, match=r"rope_layers=\(False, True\) \(reads back as \(True, False\)\)"):
        config_to_hf(config.replace(rope_layers=(False, True)), family="exaone4")
    assert config.replace(rope_layers=[True, True]).rope_layers is None  # every layer rotates


def test_exaone4_a_pattern_string_without_layer_types_is_refused(tmp_path):
    """transformers derives the layers from an integer period only; a string is not guessed at."""
    path = rewritten(Exaone4Config(**DIMS, sliding_window=4), tmp_path, ["layer_types"], sliding_window_pattern="LLLG")
    with pytest.raises(HFError, match="sliding_window_pattern='LLLG'"):
        load_hf_config(path)


@pytest.mark.parametrize("built", ["hunyuan_v1_dense"], indirect=True)
def test_hunyuan_qk_norm_after_rotary_matters(built):
    """Qwen3 (the same tensors, the norms before rotary) gives other logits; shardzoo with the
    norms before rotary gives Qwen3's."""
    path, model, ref = built
    c = model.config
    qwen3 = AutoModelForCausalLM.from_config(
        Qwen3Config(**DIMS, head_dim=8, attention_bias=True, rms_norm_eps=c.rms_norm_eps,
                    rope_theta=c.rope_parameters["rope_theta"]), attn_implementation="eager").eval()
    renamed = {k.replace("query_layernorm", "q_norm").replace("key_layernorm", "k_norm"): v
               for k, v in model.state_dict().items()}
    qwen3.load_state_dict(renamed)
    before = hf_logits(qwen3)
    assert np.abs(before - ref).max() > 1e-2
    np.testing.assert_allclose(_shardzoo(path, qk_norm_after_rope=False), before, atol=TOL, rtol=0)


def test_hunyuan_ntk_alpha_rotary_imports_as_its_stretched_base(tmp_path):
    """The published models' rotary ("dynamic" with a fixed alpha, transformers' static
    ntk_alpha): plain rotary with base theta * alpha ** (d / (d - 2)), transformers' logits."""
    hf_config = HunYuanDenseV1Config(**DIMS, head_dim=8, rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, alpha=1000.0, factor=1.0))
    model = randomize(AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval(), DRAW, seed=0)
    model.save_pretrained(tmp_path)
    config = load_hf_config(str(tmp_path))
    assert config.rope_scaling is None and config.rope_theta == pytest.approx(10000.0 * 1000.0 ** (8 / 6))
    module, _, params = load_hf(str(tmp_path), mesh=one_device(), rules=get_rules("fsdp"))
    np.testing.assert_allclose(apply(module, params, one_device()), hf_logits(model), atol=TOL, rtol=0)


@pytest.mark.parametrize("built", ["seed_oss"], indirect=True)
def test_seed_oss_biases_each_matter_and_an_output_bias_imports(built, tmp_path):
    """Zeroing any one kind of bias changes transformers' logits; a model with the o bias on
    too matches (and is then Llama's config: one flag for q/k/v/o, and mlp_bias)."""
    _, model, ref = built
    for kind in ("q_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"):
        other = _like(model)
        with torch.no_grad():
            for name, p in other.named_parameters():
                if name.endswith(kind):
                    p.zero_()
        assert np.abs(hf_logits(other) - ref).max() > 1e-2, kind
    out_bias = randomize(AutoModelForCausalLM.from_config(
        SeedOssConfig(**(model.config.to_dict() | dict(attention_out_bias=True))),
        attn_implementation="eager").eval(), DRAW, seed=1)
    out_bias.save_pretrained(tmp_path)
    config = load_hf_config(str(tmp_path))
    assert config.attention_out_bias and family_of_config(config).name == "llama"
    np.testing.assert_allclose(_shardzoo(str(tmp_path)), hf_logits(out_bias), atol=TOL, rtol=0)
