"""Zamba2: Mamba2 layers and weight-shared attention + MLP blocks (models/shared_block.py).

A tiny random HF model of 2 mamba layers (scanned) and 3 hybrid ones (each a shared block, then a
Mamba2 mixer; unrolled), running blocks 0, 1, 0 (block 0 twice), adapters on q, k, v and the MLP, rotary in the shared attention: logits equal
transformers' on one device (1e-4), greedy tokens equal over 16, export then ``from_pretrained``
equal; the second use of a block, the adapters and the embeddings beside the stream each move
the logits; under fsdp_tp on 8 devices the logits equal transformers' too (1e-4).
"""

import os
import sys

import jax
import numpy as np
import pytest
import torch
from transformers import Zamba2Config

from shardzoo.sharding import get_rules, make_mesh
from shardzoo.sharding.partition import activate
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402, F401  (test_*: the three proofs every family has, collected here on its built)
    TOKENS,
    TOL,
    apply,
    config_of,
    edit,
    mamba_draw,
    one_device,
    randomized,
    saved,
    test_export_round_trip_loads_the_same_model,
    test_greedy_generate_matches_transformers,
    test_logits_match_on_one_device,
)

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, bos_token_id=None,
            eos_token_id=None)
CONFIGS = {
    "zamba2": lambda: Zamba2Config(
        **DIMS, num_hidden_layers=5,
        layers_block_type=["mamba", "mamba", "hybrid", "hybrid", "hybrid"], num_mem_blocks=2,
        adapter_rank=4, use_shared_attention_adapter=True, use_mem_rope=True, n_mamba_heads=4, mamba_ngroups=2,
        mamba_d_state=8, chunk_size=8, time_step_min=0.01),
}
MOVED = 1e-2  # a mechanism switched off moves some logit by more than this


def zamba_draw(name, p):
    """mamba_draw's A_log, dt_bias and norms (the shared blocks' "layernorm"s too) and 0.1 x normal
    elsewhere: at mamba_draw's 0.2 the 2 x hidden wide blocks amplify float32 rounding past 1e-4."""
    name = name.replace("layernorm", "norm")
    return mamba_draw(name, p) if any(k in name for k in ("A_log", "dt_bias", "norm")) else 0.1 * torch.randn_like(p)


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    model = randomized(CONFIGS[request.param](), seed=0, draw=zamba_draw)
    return saved(model, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def loaded(built):
    """(module, config, params, logits of params): one jitted forward on one device, reused."""
    module, config, params = load_hf(built[0], mesh=one_device())
    fn = jax.jit(lambda p, t: module.apply({"params": p}, t))
    with activate(one_device()):
        return config, params, lambda p: np.asarray(fn(p, TOKENS))


def test_the_shared_blocks_are_stored_once_and_their_uses_unrolled(loaded):
    config, params, _ = loaded
    assert sorted(k for k in params if k.startswith("shared_")) == ["shared_0", "shared_1"]
    assert {"out_0", "out_2", "mlp_adapter_0", "mlp_adapter_2"} <= set(params["shared_0"])
    assert {"out_1", "mlp_adapter_1"} <= set(params["shared_1"])
    assert [s.shared for s in config.layer_specs()] == [None, None, 0, 1, 2]
    assert config.param_layout()[0] == (("layers",), (0, 1), True)  # the mamba layers scanned, the rest not


def _without(params, mechanism, d):
    """``params`` with one mechanism cut out."""
    if mechanism == "reuse":  # block 0's second use (layer 4) adds nothing
        return edit(params, "['shared_0']['out_2']['kernel']", np.zeros_like)
    if mechanism == "adapters":  # every adapter kernel zeroed
        return jax.tree_util.tree_map_with_path(
            lambda p, x: np.zeros_like(x) if "adapter_" in jax.tree_util.keystr(p) else x, params)
    # the norms' scales on the embeddings' half zeroed: the shared blocks read the stream only
    return edit(params, "['attn_norm']['scale']", lambda x: x.at[d:].set(0) if x.shape[0] == 2 * d else x)


def test_each_mechanism_moves_the_logits(built, loaded):
    config, params, logits = loaded
    full = logits(params)
    np.testing.assert_allclose(full, built[2], atol=TOL, rtol=0)
    for mechanism in ("reuse", "adapters", "embeddings"):
        moved = np.abs(logits(_without(params, mechanism, config.arch.hidden_size)) - full).max()
        print(f"{mechanism}: max |logit change| {moved:.2e}")
        assert moved > MOVED, mechanism


def test_fsdp_tp_equals_transformers(built):
    """The shared blocks' q kernel split over fsdp (its 2 x hidden inputs) and tensor (heads); the
    logits on 8 devices within TOL of transformers', as on one (test_logits_match_on_one_device)."""
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(built[0], mesh=mesh, rules=get_rules("fsdp_tp"))
    q = params["shared_0"]["attn"]["q"]["kernel"]
    assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
    np.testing.assert_allclose(apply(module, params, mesh), built[2], atol=TOL, rtol=0)


@pytest.mark.parametrize("field, value", [("add_bias_linear", True), ("use_long_context", True),
                                          ("rms_norm_eps", 1e-6)])
def test_a_field_that_changes_the_math_and_is_not_implemented_is_refused(field, value):
    from shardzoo.models.hf import HFError

    with pytest.raises(HFError, match=field):
        config_of(CONFIGS["zamba2"]().to_dict() | {field: value})


def test_the_plan_counts_every_use_of_the_shared_blocks():
    """The activation estimate keeps each use's arrays whole (the uses run outside the layers'
    remat): a term per model that grows with the uses and with the attention's length squared, the
    same under every remat policy. (The tiny model's plan against its compiled fsdp=8 step rose
    from 0.47 to 0.72 with it; the rest of the gap is Mamba2's.)"""
    config = config_of(CONFIGS["zamba2"]())
    uses = len(config.arch.shared_block.layers)
    assert uses == 3

    def term(c, seq_len=64, **execution):
        c = c.replace(**execution) if execution else c
        return c.activation_estimate(16, seq_len, lambda names: 1).terms["shared_blocks"]

    one = term(config.replace(shared_block_layers=[2]))
    assert one > 0 and term(config) == uses * one
    assert term(config, remat_policy="full") == term(config)
    h = config.arch.num_attention_heads
    # twice the length: twice the per-token arrays; the scores (float32 compute) and float32
    # probabilities, h x length a token, grow with the square
    assert term(config, 128) - 2 * term(config) == uses * 16 * h * (4 + 4) * (128 * 128 - 2 * 64 * 64)
