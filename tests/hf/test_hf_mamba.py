"""Mamba and Falcon-Mamba: every layer a Mamba1 selective-scan mixer (models/mamba1.py) after one
RMSNorm, no MLP; Falcon-Mamba normalises dt, B and C.

Tiny random HF models of 3 layers, 64 channels, state 8, dt rank 6, under sequences of 11 tokens
(with ``linear_attention_chunk`` 4: several scan chunks, the last one partial): logits equal
transformers' (its reference PyTorch scan) on one device and under fsdp_tp on 8 devices (the
channels over tensor), greedy tokens equal over 16, decoding from the cache equals the full
forward, export then ``from_pretrained`` equal, the parameter counts equal transformers', the
presets' too. Tolerance: 1e-4 on float32 logits against transformers, 1e-5 shardzoo against itself.
"""

import os
import sys

import jax
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P
from transformers import AutoModelForCausalLM, FalconMambaConfig, MambaConfig

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

CONFIG = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, state_size=8, conv_kernel=4, expand=2,
              time_step_rank=6, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
TOKENS = np.random.default_rng(0).integers(0, 128, size=(4, 11)).astype(np.int32)
CHUNK = dict(linear_attention_chunk=4)  # the scan's chunks: 11 tokens in 3
KINDS = {"mamba": MambaConfig, "falcon_mamba": FalconMambaConfig}


_BUILT = {}


def _built(kind, tmp_path_factory):
    """(kind, HF dir, HF model, reference logits), made once per kind: A = -exp(A_log) in [-2.5,
    -0.5], the rest 0.2 x normal."""
    if kind not in _BUILT:
        model = randomized(KINDS[kind](**CONFIG), seed=1, draw=mamba_draw)
        _BUILT[kind] = (kind, *saved(model, tmp_path_factory.mktemp(kind), TOKENS))
    return _BUILT[kind]


@pytest.fixture(scope="module", params=list(KINDS))
def built(request, tmp_path_factory):
    """Each family's tiny model (the checks every family has)."""
    return _built(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    """Mamba's tiny model alone (the mixer's own checks, once: the decoding cache, left padding)."""
    return _built("mamba", tmp_path_factory)


def _load(path, mesh=None, rules="fsdp"):
    return load_hf(path, mesh=mesh or one_device(), rules=get_rules(rules), overrides=CHUNK)


def test_config_reads_the_mixer(built):
    kind, path, _, _ = built
    config = load_hf_config(path)
    m = config.mamba1
    assert config.layer_types == ("mamba1",) * 3 and config.mlp_layer_types == ("none",) * 3
    assert (m.intermediate_size, m.state_size, m.dt_rank, m.conv_kernel, m.conv_bias) == (64, 8, 6, 4, True)
    assert m.bcdt_rms_eps == (1e-6 if kind == "falcon_mamba" else None)


def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    """And each mechanism moves them: the convolution, the D skip, the gate, the decays (A), B,
    the dt bias (and Falcon-Mamba's norms: without them the logits move)."""
    kind, path, _, ref = built
    module, config, params = _load(path)
    got = apply(module, params, one_device(), TOKENS)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    for suffix, fn in (("['conv']", lambda x: 0 * x), ("['D']", lambda x: 0 * x), ("['A_log']", lambda x: x + 1.0),
                       ("['in_z']['kernel']", lambda x: 0 * x), ("['x_b']['kernel']", lambda x: x[..., ::-1]),
                       ("['dt_bias']", lambda x: x + 2.0)):
        assert np.abs(apply(module, edit(params, suffix, fn), one_device(), TOKENS) - ref).max() > 1e-2, suffix
    other = config.replace(mamba1_bcdt_rms_eps=None if kind == "falcon_mamba" else 1e-6).build()
    assert np.abs(apply(other, params, one_device(), TOKENS) - ref).max() > 1e-2
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = _load(path, mesh, "fsdp_tp")
    m = params["layers"]["mamba"]
    assert m["in_x"]["kernel"].sharding.spec == P(None, "fsdp", "tensor")  # [layers, embed, inner]
    assert m["A_log"].sharding.spec == P(None, "tensor", None)  # [layers, inner, state]
    assert m["x_dt"]["kernel"].sharding.spec == P(None, "tensor", None)  # [layers, inner, dt_rank]
    assert m["out"]["kernel"].sharding.spec == P(None, "tensor", "fsdp")
    sharded = apply(module, params, mesh, TOKENS)
    np.testing.assert_allclose(sharded, ref, atol=TOL, rtol=0)
    print(f"{kind}: max |logit diff| one device {np.abs(got - ref).max():.2e}, fsdp_tp {np.abs(sharded - ref).max():.2e}")


def test_parameter_count_equals_transformers(built):
    _, path, model, _ = built
    assert load_hf_config(path).num_params() == sum(p.numel() for p in model.parameters())


def test_biases_and_an_explicit_inner_width_match_transformers(tmp_path):
    """in_proj/out_proj biases (use_bias), no conv bias; config.json's intermediate_size (here 48,
    not expand x hidden_size = 64) is the inner width, as transformers reads it."""
    hf = MambaConfig(**(CONFIG | dict(use_bias=True, use_conv_bias=False)))
    hf.intermediate_size = 48
    path, model, ref = saved(randomized(hf, seed=2, draw=mamba_draw), tmp_path, TOKENS)
    module, config, params = _load(path)
    assert config.mamba1.proj_bias and not config.mamba1.conv_bias and config.mamba1.intermediate_size == 48
    np.testing.assert_allclose(apply(module, params, one_device(), TOKENS), ref, atol=TOL, rtol=0)
    assert config.num_params() == sum(p.numel() for p in model.parameters())


def test_decoding_from_the_cache_equals_the_full_forward(mamba):
    """A prefill of 6 tokens (one chunk and a half) then 5 single steps give the full forward's
    logits (1e-5): each layer's cache carries its conv inputs and its state."""
    _, path, _, _ = mamba
    module, _, params = _load(path)
    full = apply(module, params, one_device(), TOKENS)
    cache = jax.jit(cache_init_fn(module, TOKENS.shape[0], TOKENS.shape[1]))(params)
    m = cache["layers"]["mamba"]  # the scanned layers' caches: a leading layers axis
    assert m["ssm_state"].value.shape == (3, 4, 64, 8)  # [layers, batch, inner, state]
    assert m["conv_state"].value.shape == (3, 4, 3, 64)  # [layers, batch, w - 1, inner]
    got = decoded(module, params, cache, TOKENS, prefill=6)
    np.testing.assert_allclose(got, full, atol=1e-5, rtol=1e-5)


def test_cache_is_sharded_by_its_logical_axes(mamba):
    _, path, _, _ = mamba
    _, config, _ = _load(path)
    program = Program(config, get_rules("fsdp_tp"), make_mesh("data=2,fsdp=2,tensor=2"))
    shapes, shardings = program.decoding.cache_shardings(8, 16)
    m = shardings["layers_2"]["mamba"]
    assert m["ssm_state"].spec == P(("data", "fsdp"), "tensor", None)  # [batch, inner, state]
    assert m["conv_state"].spec == P(("data", "fsdp"), None, "tensor")  # [batch, w - 1, inner]
    longer, _ = program.decoding.cache_shardings(8, 1024)  # a mamba1 layer's cache does not grow with the length
    assert jax.tree.map(lambda x: x.shape, longer["layers_2"]) == jax.tree.map(lambda x: x.shape, shapes["layers_2"])


def test_greedy_generate_matches_transformers(built, parity):
    _, path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_left_padded_rows_generate_as_they_do_alone(mamba):
    _, path, _, _ = mamba
    _, config, params = _load(path)
    left_padded_generates_alone(Program(config, get_rules("fsdp"), one_device()), params, TOKENS)


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    kind, path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["model_type"] == kind and hf["intermediate_size"] == 64 and hf["time_step_rank"] == 6
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_only_falcon_mamba_expresses_the_norms(built):
    kind, path, _, _ = built
    config = load_hf_config(path)
    if kind == "falcon_mamba":
        with pytest.raises(HFError, match=r"mamba cannot express feature mamba1_bcdt_norm"):
            config_to_hf(config, family="mamba")
    else:
        with pytest.raises(HFError, match=r"falcon_mamba cannot express mamba1_bcdt_rms_eps=None \(reads back as 1e-06\)"):
            config_to_hf(config, family="falcon_mamba")


def test_bad_settings_are_one_line(tmp_path):
    from shardzoo.models import ModelError, get_model

    with pytest.raises(ModelError, match="mamba1_dt_rank=0 must be an integer >= 1"):
        get_model("mamba-tiny", mamba1_dt_rank=0)
    with pytest.raises(ModelError, match="mamba1_conv_kernel=1 must be an integer >= 2"):
        get_model("mamba-tiny", mamba1_conv_kernel=1)
    with pytest.raises(HFError, match=r"hidden_act='gelu': the mamba1 mixer's activation is SiLU"):
        load_hf_config(rewritten(MambaConfig(**CONFIG), tmp_path, hidden_act="gelu"))


@pytest.mark.parametrize("name,cls,hf", [
    ("mamba-130m", MambaConfig, dict(vocab_size=50280, hidden_size=768, num_hidden_layers=24, time_step_rank=48)),
    ("mamba-2.8b", MambaConfig, dict(vocab_size=50280, hidden_size=2560, num_hidden_layers=64, time_step_rank=160)),
    ("falcon-mamba-7b", FalconMambaConfig, dict(vocab_size=65024, hidden_size=4096, num_hidden_layers=64, expand=16,
                                                intermediate_size=8192, time_step_rank=256, tie_word_embeddings=False)),
])
def test_the_presets_count_as_transformers_counts(name, cls, hf):
    """The published configs (state-spaces/mamba-130m-hf, mamba-2.8b-hf, tiiuae/falcon-mamba-7b,
    whose config.json says expand 16 beside intermediate_size 8192) on the meta device."""
    from shardzoo.models import get_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cls.from_dict(hf))
    assert get_config(name).num_params() == sum(p.numel() for p in model.parameters()), name
