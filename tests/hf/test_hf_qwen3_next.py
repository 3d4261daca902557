"""Qwen3-Next: Gated DeltaNet layers (the shared ``gated_deltanet`` feature,
models/linear_attention.py) beside output-gated attention with partial rotary embeddings and
zero-centred norms, MoE layers with a gated shared expert.

A tiny random HF model of 4 layers (3 linear-attention : 1 attention; 4 value heads over 2 key
heads; a dense first layer, then MoE), run by shardzoo in chunks of 5 tokens (16-token rows:
4 chunks, the last one cut) where transformers runs one chunk of 64: logits equal transformers'
on one device and under fsdp_tp on 8 devices, greedy tokens equal over 16, decoding from the
cache equals the full forward, export then ``from_pretrained`` equal, the parameter count equals
transformers'. Tolerance: 1e-4 on float32 logits against transformers, 1e-5 shardzoo against itself.
"""

import os
import sys

import jax
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P
from transformers import Qwen3NextConfig

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
    config_of,
    decoded,
    edit,
    left_padded_generates_alone,
    one_device,
    randomized,
    rewritten,
    saved,
)

LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, layer_types=LAYERS,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
              linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              shared_expert_intermediate_size=24, mlp_only_layers=[0], bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
CHUNK = dict(linear_attention_chunk=5)
SCALE = 0.1  # random weights of this size keep fp32 rounding within 1e-4 through 4 layers (0.2: ~1e-4)


def draw(name, p):
    """Every weight random: norm weights near their unit scale (zero-centred norms near 0), the
    rest SCALE x normal."""
    if name.endswith("linear_attn.norm.weight"):
        return 1 + 0.1 * torch.randn_like(p)
    if "norm" in name:
        return 0.1 * torch.randn_like(p)
    return SCALE * torch.randn_like(p)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return saved(randomized(Qwen3NextConfig(**CONFIG), seed=1, draw=draw), tmp_path_factory.mktemp("qwen3_next"),
                 use_cache=False)


def _load(path, mesh=None, rules="fsdp"):
    return load_hf(path, mesh=mesh or one_device(), rules=get_rules(rules), overrides=CHUNK)


def test_config_reads_the_layer_pattern(built):
    config = load_hf_config(built[0])
    assert config.layer_types == tuple(LAYERS) and config.attn_output_gate and config.norm_type == "rmsnorm_plus_one"
    assert (config.linear_attention.num_key_heads, config.linear_attention.num_value_heads) == (2, 4)
    assert config.partial_rotary_factor == 0.25 and config.qk_norm == "head"
    assert [s.mixer for s in config.layer_specs()] == ["linear_attention"] * 3 + ["attention"]
    assert [s.mlp for s in config.layer_specs()] == ["dense", "moe", "moe", "moe"]
    assert config.layout().as_tuple() == (1, 1, 2)  # layer 0 and 3 unrolled, two linear MoE layers scanned


def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    path, _, ref = built
    module, _, params = _load(path)
    got = apply(module, params, one_device())
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = _load(path, mesh, "fsdp_tp")
    gdn = params["layers"]["linear_attn"]  # layers 1 and 2, scanned: a leading layers axis
    assert gdn["q"]["kernel"].sharding.spec == P(None, "fsdp", "tensor", None)  # [embed, linear_key_heads, key_dim]
    assert gdn["v"]["kernel"].sharding.spec == P(None, "fsdp", "tensor", None)  # [embed, linear_heads, value_dim]
    assert gdn["conv_v"].sharding.spec == P(None, None, "tensor", None)  # [conv_width, linear_heads, value_dim]
    assert gdn["A_log"].sharding.spec == P(None, "tensor")
    assert gdn["out"]["kernel"].sharding.spec == P(None, "tensor", None, "fsdp")
    sharded = apply(module, params, mesh)
    np.testing.assert_allclose(sharded, ref, atol=TOL, rtol=0)
    print(f"max |logit diff| one device {np.abs(got - ref).max():.2e}, fsdp_tp {np.abs(sharded - ref).max():.2e}")


def test_each_mechanism_changes_the_logits(built):
    """Each mechanism, changed, moves the logits away from transformers' (so the parity above
    could fail): the decay (A_log), the rate (b), the convolution's taps, the output gate of
    attention and of the Gated DeltaNet (z), value heads per key head, the zero-centred norms."""
    path, _, ref = built
    module, config, params = _load(path)
    edits = {"decay": ("['linear_attn']['A_log']", lambda x: x + 1.0),
             "rate": ("['linear_attn']['b']['kernel']", lambda x: 0 * x),
             "taps": ("['linear_attn']['conv_q']", lambda x: x[::-1]),
             "attention gate": ("['attn']['gate']['kernel']", lambda x: 0 * x),
             "z gate": ("['linear_attn']['z']['kernel']", lambda x: 0 * x),
             "value heads": ("['linear_attn']['v']['kernel']", lambda x: x[:, ::-1]),
             "plus-one norm": ("['attn_norm']['scale']", lambda x: x + 1.0)}
    for name, (suffix, fn) in edits.items():
        assert np.abs(apply(module, edit(params, suffix, fn), one_device()) - ref).max() > 1e-2, name
    rope = config.replace(partial_rotary_factor=1.0)  # whole heads rotate: other logits
    assert np.abs(apply(rope.build(), params, one_device()) - ref).max() > 1e-2


def test_parameter_count_equals_transformers(built):
    _, model, _ = built
    config = load_hf_config(built[0])
    assert config.num_params() == sum(p.numel() for p in model.parameters())


def test_the_80b_preset_counts_as_transformers_does():
    """qwen3-next-80b-a3b: 79,674,391,296 parameters, transformers' count of the published config
    (Qwen3NextConfig(intermediate_size=5120) on the meta device)."""
    from shardzoo.models import get_config

    config = get_config("qwen3-next-80b-a3b")
    assert config.num_params() == 79_674_391_296
    assert config.arch == config_of(_published()).arch


def _published() -> dict:
    """Qwen/Qwen3-Next-80B-A3B-Instruct/config.json."""
    return dict(architectures=["Qwen3NextForCausalLM"], attention_bias=False, attention_dropout=0.0,
                bos_token_id=151643, decoder_sparse_step=1, eos_token_id=151645, full_attention_interval=4,
                head_dim=256, hidden_act="silu", hidden_size=2048, initializer_range=0.02, intermediate_size=5120,
                linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16,
                linear_num_value_heads=32, linear_value_head_dim=128, max_position_embeddings=262144,
                mlp_only_layers=[], model_type="qwen3_next", moe_intermediate_size=512, norm_topk_prob=True,
                num_attention_heads=16, num_experts=512, num_experts_per_tok=10, num_hidden_layers=48,
                num_key_value_heads=2, output_router_logits=False, partial_rotary_factor=0.25, rms_norm_eps=1e-06,
                rope_scaling=None, rope_theta=10000000, router_aux_loss_coef=0.001,
                shared_expert_intermediate_size=512, tie_word_embeddings=False, torch_dtype="bfloat16",
                use_cache=True, use_sliding_window=False, vocab_size=151936)


def test_decoding_from_the_cache_equals_the_full_forward(built):
    """A prefill of 7 tokens (chunks of 5) then 9 single steps give the full forward's logits:
    each linear-attention layer's cache carries its recurrent state and the convolution's last
    3 inputs across calls."""
    path, _, _ = built
    module, config, params = _load(path)
    full = apply(module, params, one_device())
    cache = jax.jit(cache_init_fn(module, TOKENS.shape[0], TOKENS.shape[1]))(params)
    gdn = cache["layers_0"]["linear_attn"]
    assert gdn["recurrent_state"].value.shape == (4, 4, 8, 12)  # [batch, linear_heads, key_dim, value_dim]
    assert gdn["conv_v"].value.shape == (4, 3, 4, 12)  # [batch, conv_width - 1, linear_heads, value_dim]
    got = decoded(module, params, cache, TOKENS, prefill=7)
    np.testing.assert_allclose(got, full, atol=1e-5, rtol=1e-5)
    print(f"max |decode - forward| {np.abs(got - full).max():.2e}")


def test_cache_is_sharded_by_its_logical_axes(built):
    _, config, _ = _load(built[0])
    program = Program(config, get_rules("fsdp_tp"), make_mesh("data=2,fsdp=2,tensor=2"))
    _, shardings = program.decoding.cache_shardings(8, 16)
    gdn = shardings["layers_0"]["linear_attn"]
    assert gdn["recurrent_state"].spec == P(("data", "fsdp"), "tensor", None, None)
    assert gdn["conv_q"].spec == P(("data", "fsdp"), None, "tensor", None)
    assert shardings["layers_3"]["attn"]["cached_key"].spec == P(("data", "fsdp"), "tensor", None, None)


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_left_padded_rows_generate_as_they_do_alone(built):
    """A short prompt left-padded (segment 0, which neither the taps nor the state see) beside a
    long one: each row continues as it does alone."""
    path, _, _ = built
    _, config, params = _load(path)
    left_padded_generates_alone(Program(config, get_rules("fsdp"), one_device()), params)


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["model_type"] == "qwen3_next" and hf["layer_types"] == LAYERS and hf["mlp_only_layers"] == [0]
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_only_qwen3_next_expresses_linear_attention(built):
    config = load_hf_config(built[0])
    with pytest.raises(HFError, match=r"cannot express feature"):
        config_to_hf(config, family="qwen2_moe")


def test_a_layer_kind_qwen3_next_has_not_is_refused(tmp_path):
    kinds = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    path = rewritten(Qwen3NextConfig(**CONFIG), tmp_path, layer_types=kinds)
    with pytest.raises(HFError, match=r"layer_types=.*Qwen3-Next's layers are 'full_attention' or 'linear_attention'"):
        load_hf_config(path)


def test_value_heads_not_a_multiple_of_key_heads_is_one_line():
    from shardzoo.models import ModelError, get_model

    with pytest.raises(ModelError, match="linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"):
        get_model("qwen3-next-tiny", linear_num_value_heads=3)


def test_train_init_from_the_hf_dir_under_fsdp_then_export_loads_in_transformers(tmp_path, parity):
    """``shardzoo train --init-from`` the tiny Qwen3-Next under fsdp on 8 devices with LoRA adapters
    (on the Gated DeltaNet's q, k, v and attention's q, k, v, o, gate): the loss falls; the merged
    export loads in transformers and computes what the run computes (1e-4). The Gated DeltaNet's
    gradients of every weight: tests/models/test_linear_attention.py."""
    model = randomized(Qwen3NextConfig(**CONFIG), seed=3, draw=draw)
    config = parity.trains_from_hf_dir(tmp_path, model, TOKENS[:2], True, TOL)
    assert config.linear_attention is not None and config.attn_output_gate
