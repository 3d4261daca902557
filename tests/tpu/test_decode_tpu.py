"""Decoding on a TPU: ``generate`` compiled with libtpu's scoped VMEM limit
(``execution.decode_vmem_kib``, which measured 57% -> 74% of the bandwidth bound for qwen3-0.6b at
batch 32 unrolled on v5e) gives the compiler default's greedy tokens, scanned and unrolled, the
packed cache included (head_dim 64 on a TPU); "auto" gives it to unrolled layers with a cache of a
quarter of the weights or more, the case it was measured to help; and ``decode_scan_unroll`` keeps
the tokens. Skips off a TPU.

    JAX_PLATFORMS=tpu python3 -m pytest -q -p no:cacheprovider tests/tpu/test_decode_tpu.py
"""

import jax
import numpy as np
import pytest

from shardzoo.models import get_model
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.program import Program


@pytest.mark.parametrize("decode_layers", ["unroll", "scan"])
def test_generate_with_the_vmem_limit_gives_the_default_tokens(decode_layers):
    _, config = get_model("llama-tiny", hidden_size=512, intermediate_size=1024, vocab_size=1024,
                          num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=4,
                          max_position_embeddings=256, decode_layers=decode_layers)
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    from jax.experimental.pallas import tpu as pltpu  # noqa: I001 - in the test: nothing touches the chip at import

    limit = pltpu.get_tpu_info().vmem_capacity_bytes * 7 // 8 // 1024
    programs = {k: Program(config.replace(decode_vmem_kib=k), get_rules("dp"), mesh) for k in (-1, limit, 0)}
    # 64 rows of 96 positions: a cache of ~1.2x the weights (float32 both); one row: ~2%
    auto = {"xla_tpu_scoped_vmem_limit_kib": limit} if decode_layers == "unroll" else {}
    assert programs[-1].decoding.compiler_options(64, 96) == auto
    assert programs[-1].decoding.compiler_options(1, 96) == {}
    assert programs[limit].decoding.compiler_options(1, 96) == {"xla_tpu_scoped_vmem_limit_kib": limit}
    assert programs[0].decoding.compiler_options(64, 96) == {}
    params = programs[0].init(np.asarray(jax.random.PRNGKey(0), np.uint32)).params
    prompt = np.random.default_rng(0).integers(1, config.vocab_size, (64, 32)).astype(np.int32)
    # float32 weights and matmuls at "highest": the limit moves buffers, not numbers (at the
    # chip's default float32 precision, which rounds the inputs to bfloat16 where XLA fuses, a
    # random model's near-ties flipped 1.5% of the tokens: ninth session); a near-tie could still
    # flip a token, so at least 99% of the new tokens must agree
    with jax.default_matmul_precision("highest"):
        tokens = {k: np.asarray(programs[k].decoding.generate(params, prompt, max_new_tokens=64)) for k in (limit, 0)}
    same = (tokens[limit][:, 32:] == tokens[0][:, 32:]).mean()
    assert same >= 0.99, same
    assert len(np.unique(tokens[0][:, 32:])) > 8  # a real continuation, not one repeated token


def test_scanned_decoding_unrolled_by_two_and_four_gives_the_same_tokens():
    """``decode_scan_unroll`` (layers per iteration of the decoding layer scan) on the chip, batch
    64 (so the decoding kernel too, as ``auto`` takes it): the same greedy tokens as one layer an
    iteration, float32 matmuls at "highest" (the rounding of the chip's default float32 matmuls
    could differ where XLA fuses across the unrolled iterations); at least 99% must agree."""
    _, config = get_model("llama-tiny", hidden_size=512, intermediate_size=1024, vocab_size=1024,
                          num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=4,
                          max_position_embeddings=256, decode_layers="scan")
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    programs = {u: Program(config.replace(decode_scan_unroll=u), get_rules("dp"), mesh) for u in (1, 2, 4)}
    params = programs[1].init(np.asarray(jax.random.PRNGKey(0), np.uint32)).params
    prompt = np.random.default_rng(0).integers(1, config.vocab_size, (64, 32)).astype(np.int32)
    with jax.default_matmul_precision("highest"):
        tokens = {u: np.asarray(p.decoding.generate(params, prompt, max_new_tokens=64)) for u, p in programs.items()}
    for u in (2, 4):
        same = (tokens[u][:, 32:] == tokens[1][:, 32:]).mean()
        print(f"decode_scan_unroll={u}: {same:.4f} of the new tokens agree with 1")
        assert same >= 0.99, (u, same)
    assert len(np.unique(tokens[1][:, 32:])) > 8


@pytest.mark.parametrize("decode_layers", ["unroll", "scan"])
def test_flat_head_kernels_give_the_declared_kernels_tokens(decode_layers):
    """``decode_flat_heads`` on the chip: head_dim 64 (padded to the 128 lanes where a kernel
    holds it minor), so "auto" stores q, k and v flat; the same greedy tokens as "off" at batch 1
    and 64 (float32 weights, matmuls at "highest"); at least 99% must agree."""
    _, config = get_model("llama-tiny", hidden_size=512, intermediate_size=1024, vocab_size=1024,
                          num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=4,
                          max_position_embeddings=256, decode_layers=decode_layers)
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    programs = {f: Program(config.replace(decode_flat_heads=f), get_rules("dp"), mesh) for f in ("auto", "off")}
    assert programs["auto"].decoding._flat_head_dims(64) and programs["off"].decoding._flat_head_dims is None
    params = programs["off"].init(np.asarray(jax.random.PRNGKey(0), np.uint32)).params
    for rows in (1, 64):
        prompt = np.random.default_rng(rows).integers(1, config.vocab_size, (rows, 32)).astype(np.int32)
        with jax.default_matmul_precision("highest"):
            tokens = {f: np.asarray(p.decoding.generate(params, prompt, max_new_tokens=64)) for f, p in programs.items()}
        same = (tokens["auto"][:, 32:] == tokens["off"][:, 32:]).mean()
        print(f"batch {rows}: {same:.4f} of the new tokens agree")
        assert same >= 0.99, (rows, same)
