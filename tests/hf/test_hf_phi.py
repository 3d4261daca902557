"""Phi (1, 1.5, 2): attention and MLP side by side from one LayerNorm (the parallel residual, a
feature of the shared layers), partial rotary, biases everywhere, the output head's bias (a
feature too) and the per-head qk LayerNorm.

A tiny random HF model with every mechanism on (partial_rotary_factor 0.5, qk_layernorm, every
bias random): logits equal transformers' on one device and under fsdp_tp on 8 devices, greedy
tokens equal, export then ``from_pretrained`` equal. Tolerance: 1e-4 on float32 logits.
"""

import os
import sys

import numpy as np
import pytest
from transformers import AutoModelForCausalLM, PhiConfig

from shardzoo.models.hf import HFError, config_to_hf, export_hf, load_hf_config
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
    near_one,
    one_device,
    randomized,
    saved,
)

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
CONFIG = dict(DIMS, qk_layernorm=True, partial_rotary_factor=0.5, bos_token_id=1, eos_token_id=2)
# every weight random (biases too), the LayerNorms' scales near 1
DRAW = near_one(lambda name, p: "layernorm" in name and name.endswith("weight"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    model = randomized(PhiConfig(**CONFIG), seed=2, draw=DRAW)  # a seed whose greedy continuation varies
    return saved(model, tmp_path_factory.mktemp("phi"))


def test_config_reads_phis_mechanisms(built):
    config = load_hf_config(built[0])
    assert config.block_form == "parallel" and config.lm_head_bias and config.qk_norm == "head"
    assert (config.norm_type, config.mlp_type, config.partial_rotary_factor) == ("layernorm", "plain", 0.5)


def test_the_parallel_residual_and_the_head_bias_matter(built):
    """The same weights run as a sequential block (x + attn(ln x), then + mlp(ln' x) with the
    one LayerNorm's weights) or without the head's bias give other logits than transformers':
    so a family that dropped either could not pass the parity tests below."""
    path, _, ref = built
    mesh = one_device()
    module, config, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp"))
    np.testing.assert_allclose(apply(module, params, mesh), ref, atol=TOL, rtol=0)

    sequential = config.replace(parallel_residual=False)
    layers = dict(params["layers"], mlp_norm=params["layers"]["attn_norm"])
    got = apply(Transformer(sequential), dict(params, layers=layers), mesh)
    assert np.abs(got - ref).max() > 1e-2

    no_bias = dict(params, lm_head=dict(params["lm_head"], bias=np.zeros(config.vocab_size, np.float32)))
    assert np.abs(apply(module, no_bias, mesh) - ref).max() > 1e-2


def test_partial_rotary_and_qk_layernorm_matter(built):
    """transformers itself: another rotary fraction, or no qk LayerNorm, changes the logits."""
    _, model, ref = built
    for change in (dict(partial_rotary_factor=1.0), dict(qk_layernorm=False)):
        other = AutoModelForCausalLM.from_config(PhiConfig(**(CONFIG | change)), attn_implementation="eager").eval()
        other.load_state_dict(model.state_dict(), strict=False)
        assert np.abs(hf_logits(other, TOKENS) - ref).max() > 1e-2, change


def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    path, model, ref = built
    got, sharded = fsdp_tp_parity(path, ref)
    print(f"max |logit diff| one device {np.abs(got - ref).max():.2e}, fsdp_tp {np.abs(sharded - ref).max():.2e}")


def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert hf["model_type"] == "phi" and hf["partial_rotary_factor"] == 0.5 and hf["qk_layernorm"] is True
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


def test_a_family_without_the_parallel_residual_refuses_to_export_it(built):
    config = load_hf_config(built[0])
    with pytest.raises(HFError, match=r"gpt2 cannot express feature .*parallel_residual \(block_form='parallel'\)"):
        config_to_hf(config, family="gpt2")


def test_partial_rotary_factor_defaults_as_transformers_reads_it(tmp_path):
    """config.json without a factor means PhiConfig's 0.5; the Hub's phi-2 writes it at the top
    level (0.4; 0.25 here, a whole pair of this tiny head) beside a legacy rope_theta;
    shardzoo reads what transformers reads."""
    import json

    from transformers import AutoConfig

    PhiConfig(**DIMS).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    hf = json.loads(path.read_text())
    for raw, want in ((dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), 0.5),
                      (dict(rope_parameters=None, rope_theta=10000.0, rope_scaling=None, partial_rotary_factor=0.25),
                       0.25)):
        path.write_text(json.dumps(hf | raw))
        assert AutoConfig.from_pretrained(tmp_path).rope_parameters["partial_rotary_factor"] == want
        assert load_hf_config(str(tmp_path)).partial_rotary_factor == want


def test_a_tied_head_keeps_its_bias(tmp_path):
    """tie_word_embeddings: the head is the embedding, its bias a parameter of its own."""
    path, model, ref = saved(randomized(PhiConfig(**CONFIG, tie_word_embeddings=True), seed=2, draw=DRAW),
                             tmp_path / "hf")
    one = one_device()
    module, config, params = load_hf(path, mesh=one, rules=get_rules("fsdp"))
    assert config.tie_word_embeddings and "lm_head" not in params and params["lm_head_bias"].shape == (128,)
    np.testing.assert_allclose(apply(module, params, one), ref, atol=TOL, rtol=0)
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    export_hf(config, params, str(tmp_path / "out"))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(back, TOKENS), ref, atol=TOL, rtol=0)
