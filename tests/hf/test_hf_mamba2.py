"""Mamba2: every layer a Mamba2 state-space mixer (the shared ``mamba2`` feature, models/ssm.py)
after one RMSNorm, no MLP.

A tiny random HF model of 3 layers, 8 heads of 8 in 2 groups (groups < heads), state 8, chunks
of 4 tokens under sequences of 11 (several chunks, the last one partial): logits equal
transformers' (its reference PyTorch scan) on one device and under fsdp_tp on 8 devices, greedy
tokens equal over 16, decoding from the cache equals the full forward, export then
``from_pretrained`` equal, the parameter count equals transformers'. Tolerance: 1e-4 on float32
logits against transformers, 1e-5 shardzoo against itself.
"""

import os
import sys

import jax
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P
from transformers import AutoModelForCausalLM, Mamba2Config

from shardzoo.models.decode import cache_init_fn
from shardzoo.models.hf import HFError, config_to_hf, export_hf, load_hf_config
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf
from shardzoo.train.program import Program

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOL,
    apply,
    decoded,
    edit,
    left_padded_generates_alone,
    mamba_draw,
    one_device,
    randomized,
    rewritten,
    saved,
)

CONFIG = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_heads=8, head_dim=8, n_groups=2, state_size=8,
              conv_kernel=4, chunk_size=4, expand=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
TOKENS = np.random.default_rng(0).integers(0, 128, size=(4, 11)).astype(np.int32)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF dir, HF model, reference logits): every weight random, A = -exp(A_log) in [-2.5, -0.5],
    dt_bias around 0, norm scales near 1, the rest 0.2 x normal."""
    return saved(randomized(Mamba2Config(**CONFIG), seed=1, draw=mamba_draw), tmp_path_factory.mktemp("mamba2"),
                 TOKENS)


def _apply(module, params, mesh):
    return apply(module, params, mesh, TOKENS)


def test_config_reads_the_mixer(built):
    config = load_hf_config(built[0])
    assert config.layer_types == ("mamba",) * 3 and config.mlp_layer_types == ("none",) * 3
    assert (config.mamba.num_heads, config.mamba.head_dim, config.mamba.n_groups, config.mamba.state_size) == (8, 8, 2, 8)
    assert config.mamba.chunk_size == 4 and config.mamba.conv_kernel == 4 and config.mamba.conv_bias
    assert config.mamba.time_step_limit == (0.0, float("inf"))
    assert [(s.mixer, s.mlp) for s in config.layer_specs()] == [("mamba", "none")] * 3


def test_each_mechanism_changes_transformers_logits(built):
    """Without the convolution, the D skip, the gate, with other decays (A) or one group's B and
    C for all heads, the logits move away from transformers': the parity below could fail."""
    path, _, ref = built
    module, _, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"))
    np.testing.assert_allclose(_apply(module, params, one_device()), ref, atol=TOL, rtol=0)
    for suffix, fn in (("['conv_x']", lambda x: 0 * x), ("['D']", lambda x: 0 * x),
                       ("['A_log']", lambda x: x + 1.0), ("['in_z']['kernel']", lambda x: 0 * x),
                       ("['in_b']['kernel']", lambda x: x[..., :1, :].repeat(2, axis=-2)),
                       ("['dt_bias']", lambda x: x + 2.0)):
        assert np.abs(_apply(module, edit(params, suffix, fn), one_device()) - ref).max() > 1e-2, suffix


def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    path, _, ref = built
    module, _, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"))
    got = _apply(module, params, one_device())
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    m = params["layers"]["mamba"]
    assert m["in_x"]["kernel"].sharding.spec == P(None, "fsdp", "tensor", None)  # [layers, embed, ssm_heads, head_dim]
    assert m["in_b"]["kernel"].sharding.spec == P(None, "fsdp", None, None)  # [layers, embed, ssm_groups, ssm_state]
    assert m["A_log"].sharding.spec == P(None, "tensor")
    assert m["out"]["kernel"].sharding.spec == P(None, "tensor", None, "fsdp")
    sharded = _apply(module, params, mesh)
    np.testing.assert_allclose(sharded, ref, atol=TOL, rtol=0)
    print(f"max |logit diff| one device {np.abs(got - ref).max():.2e}, fsdp_tp {np.abs(sharded - ref).max():.2e}")


def test_parameter_count_equals_transformers(built):
    _, model, _ = built
    config = load_hf_config(built[0])
    assert config.num_params() == sum(p.numel() for p in model.parameters())


def test_biases_and_a_clamp_match_transformers(tmp_path):
    """in_proj/out_proj biases (use_bias), no conv bias, and dt clamped to [0.05, 0.5]."""
    model = randomized(Mamba2Config(**(CONFIG | dict(use_bias=True, use_conv_bias=False,
                                                     time_step_limit=(0.05, 0.5)))), seed=2, draw=mamba_draw)
    path, model, ref = saved(model, tmp_path, TOKENS)
    module, config, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"))
    assert config.mamba.proj_bias and not config.mamba.conv_bias and config.mamba.time_step_limit == (0.05, 0.5)
    np.testing.assert_allclose(_apply(module, params, one_device()), ref, atol=TOL, rtol=0)
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    unclamped = config.replace(time_step_limit=(0.0, float("inf"))).build()
    assert np.abs(_apply(unclamped, params, one_device()) - ref).max() > 1e-2


def test_decoding_from_the_cache_equals_the_full_forward(built):
    """A prefill of 6 tokens (one chunk and a half) then 5 single steps give the full forward's
    logits (1e-5): each mamba layer's cache carries its conv inputs and its state."""
    path, _, _ = built
    module, config, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"))
    full = _apply(module, params, one_device())
    cache = jax.jit(cache_init_fn(module, TOKENS.shape[0], TOKENS.shape[1]))(params)
    m = cache["layers"]["mamba"]  # the scanned layers' caches: a leading layers axis
    assert m["ssm_state"].value.shape == (3, 4, 8, 8, 8)  # [layers, batch, heads, head_dim, state]
    assert m["conv_x_state"].value.shape == (3, 4, 3, 8, 8)  # [layers, batch, w - 1, heads, head_dim]
    got = decoded(module, params, cache, TOKENS, prefill=6)
    np.testing.assert_allclose(got, full, atol=1e-5, rtol=1e-5)
    print(f"max |decode - forward| {np.abs(got - full).max():.2e}")


def test_cache_is_sharded_by_its_logical_axes(built):
    _, config, _ = load_hf(built[0], mesh=one_device(), rules=get_rules("fsdp"))
    program = Program(config, get_rules("fsdp_tp"), make_mesh("data=2,fsdp=2,tensor=2"))
    shapes, shardings = program.decoding.cache_shardings(8, 16)
    m = shardings["layers_2"]["mamba"]
    assert m["ssm_state"].spec == P(("data", "fsdp"), "tensor", None, None)  # [batch, ssm_heads, head_dim, state]
    assert m["conv_x_state"].spec == P(("data", "fsdp"), None, "tensor", None)
    assert m["conv_b_state"].spec == P(("data", "fsdp"), None, None, None)
    longer, _ = program.decoding.cache_shardings(8, 1024)  # a mamba layer's cache does not grow with the length
    assert jax.tree.map(lambda x: x.shape, longer["layers_2"]) == jax.tree.map(lambda x: x.shape, shapes["layers_2"])


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_left_padded_rows_generate_as_they_do_alone(built):
    """A batch of a short and a long prompt (the short one left-padded, its padding segment 0,
    which neither the convolutions nor the state see) continues each row as it continues alone."""
    path, _, _ = built
    _, config, params = load_hf(path, mesh=one_device(), rules=get_rules("fsdp"))
    left_padded_generates_alone(Program(config, get_rules("fsdp"), one_device()), params, TOKENS)


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["model_type"] == "mamba2" and hf["num_heads"] == 8 and hf["n_groups"] == 2 and hf["chunk_size"] == 4
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_only_the_mamba_families_express_mamba_layers(built):
    config = load_hf_config(built[0])
    with pytest.raises(HFError, match=r"lfm2 cannot express feature mlp_free_layers"):
        config_to_hf(config, family="lfm2")


def test_an_inconsistent_inner_width_is_one_line(tmp_path):
    path = rewritten(Mamba2Config(**CONFIG), tmp_path, num_heads=4)
    with pytest.raises(HFError, match=r"num_heads=4: num_heads x head_dim = 32 must be expand x hidden_size = 64"):
        load_hf_config(path)


def test_bad_mamba_settings_are_one_line():
    from shardzoo.models import ModelError, get_model

    with pytest.raises(ModelError, match="mamba_n_groups=3 must divide mamba_num_heads=8"):
        get_model("mamba2-tiny", mamba_n_groups=3)
    with pytest.raises(ModelError, match="neither a mixer .* nor an MLP"):
        get_model("mamba2-tiny", layer_types=("mamba", "none"))


def test_the_preset_counts_as_transformers_counts():
    from shardzoo.models import get_config

    for name, hf in (("mamba2-130m", dict(vocab_size=50288, hidden_size=768, num_hidden_layers=24, num_heads=24,
                                          head_dim=64, n_groups=1, state_size=128, tie_word_embeddings=True)),
                     ("mamba2-tiny", dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_heads=8,
                                          head_dim=16, n_groups=2, state_size=16))):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(Mamba2Config(**hf))
        assert get_config(name).num_params() == sum(p.numel() for p in model.parameters()), name
