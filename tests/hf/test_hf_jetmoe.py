"""JetMoE: the mixture of attention heads (models/moa.py) beside a MoE MLP with an output bias.

A tiny random JetMoE (4 experts, top-2, in both the attention and the MLP; every weight, the
biases too, 0.3 x normal): logits equal transformers' on one device (1e-4, float32), greedy tokens equal over 16,
export then ``from_pretrained`` equal (harness's three proofs), with an rms_norm_eps far from
the layers' 1e-6 (only transformers' final norm reads it); the MoA's routing shown to move the logits; the MoA's component under ``ep`` (experts split over 4 devices, the indexed dispatch)
equal to transformers'; its parameter count and the preset's as transformers counts them.
"""

import os
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, JetMoeConfig

from shardzoo.models.hf import load_hf_config
from shardzoo.models.hf.registry import PRESETS
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402, F401  (test_*: the three proofs every family has, collected here on its built)
    TOKENS,
    TOL,
    apply,
    apply_mutable,
    edit,
    load_ep,
    near_one,
    one_device,
    randomized,
    saved,
    test_export_round_trip_loads_the_same_model,
    test_greedy_generate_matches_transformers,
    test_logits_match_on_one_device,
)

E, K = 4, 2
DIMS = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
            intermediate_size=24, num_local_experts=E, num_experts_per_tok=K, bos_token_id=None, eos_token_id=None,
            rms_norm_eps=0.5)  # the final norm's; the layers' norms keep transformers' 1e-6
CONFIGS = {"jetmoe": lambda: JetMoeConfig(**DIMS)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    # weights 0.3 x normal (norms near 1): a varied greedy continuation
    return saved(randomized(CONFIGS["jetmoe"](), 3, near_one(std=0.3)), tmp_path_factory.mktemp("jetmoe") / "hf")


def test_the_routing_of_attention_moves_the_logits(built):
    """Every token's attention through the same expert pair (the MoA router's kernel zeroed,
    ties go to the lowest experts) gives other logits: the routing is live."""
    path, _, ref = built
    module, config, params = load_hf(path, mesh=one_device())
    assert config.arch.moa.num_experts == E and config.arch.num_attention_heads == 2 * K  # kv heads x top-k
    assert (config.arch.rms_norm_eps, config.arch.layer_norms.eps) == (0.5, 1e-6)  # final norm's, layers'
    fixed = edit(params, "['attn']['router']['kernel']", lambda w: w * 0)
    assert np.abs(apply(module, fixed, one_device()) - ref).max() > 1e-2


def test_logits_match_under_ep_with_the_indexed_dispatch(built):
    """Both routed components under ``ep`` (expert=4, data=2): the MoA's q and o experts split
    4 ways, tokens reaching them through the capacity buffers (factor E / K: none dropped)."""
    path, _, ref = built
    module, _, params, mesh = load_ep(path, moe_dispatch="indexed", capacity_factor=E / K)
    layers = params["layers"]
    assert layers["attn"]["q_experts"].addressable_shards[0].data.shape[1] == 1  # [layers, expert, ...] split 4 ways
    assert layers["attn"]["o_experts"].addressable_shards[0].data.shape[1] == 1
    got, state = apply_mutable(module, params, mesh, ["metrics", "losses"])
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    assert float(np.max(state["metrics"]["layers"]["attn"]["moa_dropped_fraction"])) == pytest.approx(0)
    assert np.all(np.asarray(state["losses"]["layers"]["attn"]["moa_aux_loss"]) > 0)


def test_parameter_counts_are_transformers(built):
    """The tiny model's and jetmoe-8b's (published config) counts equal transformers' on the meta device."""
    _, model, _ = built
    assert load_hf_config(built[0]).num_params() == sum(p.numel() for p in model.parameters())
    hf = JetMoeConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                      num_key_value_heads=16, kv_channels=128, num_local_experts=8, num_experts_per_tok=2)
    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
    assert PRESETS["jetmoe-8b"].num_params() == count


