"""LFM2: gated short-convolution layers beside attention layers (the shared ``short_conv``
feature, models/conv_mixer.py), qk-norm, SwiGLU with transformers' derived width.

A tiny random HF model of 4 layers (conv, attention, conv, conv: a scanned run of two conv
layers after an unrolled prefix): logits equal transformers' on one device and under fsdp_tp on
8 devices, greedy tokens equal over 16, decoding from the cache equals the full forward,
export then ``from_pretrained`` equal, the parameter count equals transformers'. Tolerance:
1e-4 on float32 logits against transformers, 1e-5 shardzoo against itself.
"""

import os
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from transformers import Lfm2Config

from shardzoo.models.decode import cache_init_fn
from shardzoo.models.hf import HFError, config_to_hf, export_hf, load_hf_config
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf
from shardzoo.train.program import Program

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOKENS,
    TOL,
    apply,
    decoded,
    edit,
    left_padded_generates_alone,
    near_one,
    one_device,
    randomized,
    rewritten,
    saved,
)

LAYERS = ["conv", "full_attention", "conv", "conv"]
CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=72, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, layer_types=LAYERS, block_multiple_of=16,
              block_ffn_dim_multiplier=1.5, conv_L_cache=3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
DRAW = near_one(std=0.2)  # every weight random (biases too), norm scales near 1


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return saved(randomized(Lfm2Config(**CONFIG), seed=1, draw=DRAW), tmp_path_factory.mktemp("lfm2"))


def test_config_reads_the_layer_pattern_and_the_derived_mlp_width(built):
    config = load_hf_config(built[0])
    assert config.layer_types == tuple(LAYERS) and config.conv.kernel == 3 and not config.conv.bias
    assert config.intermediate_size == 80  # int(1.5 * int(2 * 72 / 3)) = 72, rounded up to a multiple of 16
    assert [s.mixer for s in config.layer_specs()] == ["conv", "attention", "conv", "conv"]
    assert config.qk_norm == "head" and config.tie_word_embeddings and config.rms_norm_eps == 1e-5
    assert config.layout().as_tuple() == (2, 1, 2)  # conv, attention unrolled; two conv layers scanned


def test_the_convolution_and_its_taps_order_matter(built):
    """Reversed taps, or a model whose conv layers were attention, give other logits than
    transformers': the parity below could fail if the convolution were wrong."""
    path, _, ref = built
    module, config, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"))
    np.testing.assert_allclose(apply(module, params, one_device()), ref, atol=TOL, rtol=0)
    flipped = edit(params, "['conv']['kernel']", lambda x: x[..., ::-1, :])
    assert np.abs(apply(module, flipped, one_device()) - ref).max() > 1e-2
    zero = edit(params, "['conv']['kernel']", lambda x: 0 * x)
    assert np.abs(apply(module, zero, one_device()) - ref).max() > 1e-2


def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    path, _, ref = built
    module, _, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"))
    got = apply(module, params, one_device())
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    conv = params["layers"]["conv"]
    assert conv["in_b"]["kernel"].sharding.spec == P(None, "fsdp", "tensor")  # [layers, embed, conv_channels]
    assert conv["kernel"].sharding.spec == P(None, None, "tensor")  # [layers, conv_width, conv_channels]
    assert conv["out"]["kernel"].sharding.spec == P(None, "tensor", "fsdp")
    sharded = apply(module, params, mesh)
    np.testing.assert_allclose(sharded, ref, atol=TOL, rtol=0)
    print(f"max |logit diff| one device {np.abs(got - ref).max():.2e}, fsdp_tp {np.abs(sharded - ref).max():.2e}")


def test_conv_biases_match_transformers(tmp_path):
    path, model, ref = saved(randomized(Lfm2Config(**(CONFIG | dict(conv_bias=True, conv_L_cache=4))), seed=2,
                                        draw=DRAW), tmp_path)
    module, config, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"))
    assert config.conv.bias and config.conv.kernel == 4
    np.testing.assert_allclose(apply(module, params, one_device()), ref, atol=TOL, rtol=0)
    assert config.num_params() == sum(p.numel() for p in model.parameters())


def test_parameter_count_equals_transformers(built):
    _, model, _ = built
    config = load_hf_config(built[0])
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    dense = config.replace(layer_types=None)  # all attention: a different count, so the test can fail
    assert dense.num_params() != config.num_params()


def test_decoding_from_the_cache_equals_the_full_forward(built):
    """A prefill of 6 tokens then 10 single steps give the full forward's logits (1e-5, and 1e-5
    relative: these random weights give logits up to ~5, and the cache's masked attention rounds
    apart from the full forward's by ~1e-5 in the prompt too): each conv layer's cache carries
    its last conv_kernel - 1 inputs across calls."""
    path, _, _ = built
    module, config, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"))
    full = apply(module, params, one_device())
    cache = jax.jit(cache_init_fn(module, TOKENS.shape[0], TOKENS.shape[1]))(params)
    assert cache["layers_0"]["conv"]["conv_state"].value.shape == (4, 2, 32)  # [batch, conv_width - 1, channels]
    got = decoded(module, params, cache, TOKENS, prefill=6)
    np.testing.assert_allclose(got, full, atol=1e-5, rtol=1e-5)
    print(f"max |decode - forward| {np.abs(got - full).max():.2e}")


def test_cache_is_sharded_by_its_logical_axes(built):
    _, config, _ = load_hf(built[0], mesh=one_device(), rules=get_rules("fsdp"))
    program = Program(config, get_rules("fsdp_tp"), make_mesh("data=2,fsdp=2,tensor=2"))
    _, shardings = program.decoding.cache_shardings(8, 16)
    assert shardings["layers_0"]["conv"]["conv_state"].spec == P(("data", "fsdp"), None, "tensor")
    # decoding runs the layers unrolled: every layer's cache its own array (no leading layers axis)
    assert shardings["layers_3"]["conv"]["conv_state"].spec == P(("data", "fsdp"), None, "tensor")
    assert shardings["layers_1"]["attn"]["cached_key"].spec == P(("data", "fsdp"), "tensor", None, None)


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_left_padded_rows_generate_as_they_do_alone(built):
    """A batch of a short and a long prompt (the short one left-padded, its padding segment 0,
    which the convolution's taps do not see) continues each row as it continues alone."""
    path, _, _ = built
    _, config, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"))
    left_padded_generates_alone(Program(config, get_rules("fsdp"), one_device()), params)


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["model_type"] == "lfm2" and hf["layer_types"] == LAYERS and hf["intermediate_size"] == 80
    assert hf["block_auto_adjust_ff_dim"] is False
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_only_lfm2_expresses_conv_layers(built):
    config = load_hf_config(built[0])
    with pytest.raises(HFError, match=r"qwen3 cannot express feature short_conv \(conv_kernel=3\)"):
        config_to_hf(config, family="qwen3")


def test_a_layer_kind_lfm2_has_not_is_refused(tmp_path):
    path = rewritten(Lfm2Config(**CONFIG), tmp_path, layer_types=["conv", "sliding_attention", "conv", "conv"])
    with pytest.raises(HFError, match=r"layer_types=.*LFM2's layers are 'full_attention' or 'conv'"):
        load_hf_config(path)


def test_the_published_lfm2_config_reads_as_the_preset(tmp_path):
    """LiquidAI/LFM2-1.2B's config.json (its older keys: block_ff_dim, full_attn_idxs,
    tie_embedding) reads as the ``lfm2-1.2b`` preset."""
    import json

    from shardzoo.models import get_config

    raw = dict(architectures=["Lfm2ForCausalLM"], block_auto_adjust_ff_dim=True, block_dim=2048,
               block_ff_dim=12288, block_ffn_dim_multiplier=1.0, block_multiple_of=256, block_norm_eps=1e-05,
               bos_token_id=1, conv_L_cache=3, conv_bias=False, conv_dim=2048, eos_token_id=7,
               full_attn_idxs=[2, 5, 8, 10, 12, 14], hidden_size=2048, initializer_range=0.02,
               max_position_embeddings=128000, model_type="lfm2", norm_eps=1e-05, num_attention_heads=32,
               num_heads=32, num_hidden_layers=16, num_key_value_heads=8, pad_token_id=0, rope_theta=1000000.0,
               tie_embedding=True, use_cache=True, vocab_size=65536)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_hf_config(str(tmp_path)).arch == get_config("lfm2-1.2b").arch


def test_an_unmodelled_conv_width_is_one_line():
    from shardzoo.models import ModelError, get_model

    with pytest.raises(ModelError, match="conv_kernel=1 must be an integer >= 2"):
        get_model("lfm2-tiny", conv_kernel=1)


def test_a_model_without_conv_layers_drops_the_conv_fields():
    from shardzoo.models import get_config

    dense = get_config("lfm2-tiny").replace(layer_types=None)
    assert dense.conv is None
