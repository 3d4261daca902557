"""Import from and export to Hugging Face: shardzoo's logits and greedy tokens equal transformers'.

Tiny random models (hidden 32, 2 layers, vocab 128) of every supported family are built with
transformers, their weights randomized (biases and norms too, so a misplaced bias shows), and
saved with save_pretrained. Tolerance: 1e-4 on float32 logits (measured ~2e-7).
"""

import copy
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import (
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from shardzoo.models.hf import export_hf, put_leaf
from shardzoo.sharding import make_mesh
from shardzoo.sharding.rules import get_rules
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import TOKENS, TOL, apply, near_one, randomized, saved  # noqa: E402

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    "llama_gqa": lambda: LlamaConfig(**DIMS),
    "llama3_rope": lambda: LlamaConfig(**DIMS, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}),
    "mistral_window": lambda: MistralConfig(**DIMS, sliding_window=4),
    "qwen2_tied": lambda: Qwen2Config(**DIMS, tie_word_embeddings=True),
    # the window on the layers from max_window_layers on (here layer 1 of 2), as transformers does
    "qwen2_window_layers": lambda: Qwen2Config(**DIMS, use_sliding_window=True, sliding_window=4,
                                               max_window_layers=1),
    # qk-norm per head, head_dim 16 given explicitly (not hidden_size / heads = 8).
    "qwen3": lambda: Qwen3Config(**DIMS, head_dim=16, tie_word_embeddings=False),
    # post-norms only, qk-norm over the whole projections, GQA.
    "olmo2": lambda: Olmo2Config(**DIMS),
    # fused qkv_proj (unequal q | k | v blocks: GQA) and gate_up_proj; a window shorter than the text.
    "phi3": lambda: Phi3Config(**DIMS, sliding_window=8, pad_token_id=2, bos_token_id=1, eos_token_id=2),
    # half of each head rotated: transformers 5 keeps the factor inside rope_parameters.
    "phi3_partial_rotary": lambda: Phi3Config(**DIMS, partial_rotary_factor=0.5, pad_token_id=2,
                                              bos_token_id=1, eos_token_id=2),
    "mixtral": lambda: MixtralConfig(**DIMS, num_local_experts=4, num_experts_per_tok=2),
    # every layer MoE (scanned), experts narrower than the dense width, top-k not renormalised;
    # mixed dense/MoE layers, drops and the aux loss: tests/hf/test_hf_qwen3_moe.py
    "qwen3_moe": lambda: Qwen3MoeConfig(**DIMS, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=16, norm_topk_prob=False),
    "gpt2": lambda: GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                               bos_token_id=1, eos_token_id=2),
}
# every weight random (norm scales near 1), so zero-initialized biases are tested too
DRAW = near_one(lambda name, p: p.ndim == 1 and ("norm" in name or ".ln_" in name) and name.endswith("weight"))


@pytest.fixture(scope="module", params=list(CONFIGS))
def built(request, tmp_path_factory):
    """(HF dir, HF model, reference logits) for one family."""
    config = CONFIGS[request.param]()
    config._attn_implementation = "eager"
    return saved(randomized(config, 0, DRAW), tmp_path_factory.mktemp(request.param))


def test_logits_match_on_one_device(built):
    path, _, ref = built
    module, _, params = load_hf(path)
    assert {d for leaf in jax.tree.leaves(params) for d in leaf.devices()} == {jax.devices()[0]}
    out = apply(module, params, make_mesh("", devices=jax.devices()[:1]))
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)


# the families that carry a component under fsdp_tp: the others only recombine these (llama3_rope's
# scaling: test_hf_rope_scaling's yarn; qwen2_tied's tied head: gpt2's; phi3_partial_rotary's
# partial rotary on the unsplit head_dim: phi3's fused weights and test_hf_phi; qwen3_moe's experts:
# mixtral's)
SHARDED = ["llama_gqa", "mistral_window", "qwen2_window_layers", "qwen3", "olmo2", "phi3", "mixtral", "gpt2"]


@pytest.mark.parametrize("built", SHARDED, indirect=True)
def test_logits_match_under_fsdp_tp_on_8_devices(built):
    path, _, ref = built
    mesh, rules = make_mesh("data=2,fsdp=2,tensor=2"), get_rules("fsdp_tp")
    module, _, params = load_hf(path, mesh=mesh, rules=rules)
    # The q kernel [layers, embed, heads, head_dim] went straight to its shards (a pattern of
    # two unlike layers is unrolled: [embed, heads, head_dim] each).
    if "layers" in params:
        q = params["layers"]["attn"]["q"]["kernel"]
        assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
        assert q.addressable_shards[0].data.shape == (2, 16, 2, q.shape[-1])
    else:
        q = params["layers_1"]["attn"]["q"]["kernel"]
        assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
        assert q.addressable_shards[0].data.shape == (16, 2, q.shape[-1])
    np.testing.assert_allclose(apply(module, params, mesh), ref, atol=TOL, rtol=0)


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, config, params = load_hf(path, scan_layers=False)  # the unrolled tree exports too
    # Phi-3's config is also Mistral's: the family a checkpoint records picks the fused layout.
    family = "phi3" if model.config.model_type == "phi3" else None
    export_hf(config, params, str(tmp_path), max_shard_bytes=30_000, family=family)  # several shards
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)


@pytest.mark.parametrize("built", ["gpt2", "qwen3", "olmo2", "phi3", "qwen3_moe"], indirect=True)  # Llama's: tests/hf/test_hf_cli.py
def test_greedy_generate_matches_transformers(built, parity):
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_put_leaf_reads_each_layer_once_and_sends_only_slices():
    mesh = make_mesh("fsdp=4,tensor=2")  # the layer axis itself sharded 4 ways
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", "tensor"))
    full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    reads = []
    arr = put_leaf(full.shape, np.float32, sharding, lambda i: reads.append(i) or full[i], n_layers=8)
    assert reads == list(range(8))
    assert {s.data.shape for s in arr.addressable_shards} == {(2, 3)}
    np.testing.assert_array_equal(np.asarray(arr), full)


@pytest.mark.parametrize("built", ["qwen2_tied"], indirect=True)
def test_dtype_converts_on_the_way_in(built, tmp_path):
    path, model, _ = built
    _, config32, p32 = load_hf(path)
    _, config16, p16 = load_hf(path, dtype="bfloat16")
    assert (config16.param_dtype, config16.dtype) == ("bfloat16", "bfloat16")
    for a, b in zip(jax.tree.leaves(p32), jax.tree.leaves(p16), strict=True):
        assert a.dtype == np.float32 and b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a).astype(jnp.bfloat16))
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path)  # bf16 on disk, read as float32
    _, _, from16 = load_hf(str(tmp_path))
    for a, b in zip(jax.tree.leaves(from16), jax.tree.leaves(p16), strict=True):
        assert a.dtype == np.float32
        # torch rounded these to bf16, ml_dtypes rounded ours: equal within one bf16 ulp (2**-7 relative).
        np.testing.assert_allclose(np.asarray(a), np.asarray(b).astype(np.float32), rtol=2**-7, atol=0)
