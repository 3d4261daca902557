"""LoRA in the one program: only the adapters train (the base is the very same array after
training), the optimizer holds state for them alone, the adapted model starts as the base model,
and every rule table gives the one-device losses."""

import functools
import os
import shutil

import jax
import numpy as np
import pytest
from flax import traverse_util

from shardzoo.models.lora import is_adapter, merge_lora, split
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.config import TrainConfig
from shardzoo.train.optim import make_optimizer
from shardzoo.train.program import Program

# Two layers (scanned) of llama-tiny's smallest trainer variant; tensor=4 divides its heads.
LORA = dict(lora_rank=4, lora_alpha=8.0, num_hidden_layers=2)
SETTINGS = TrainConfig(batch_size=8, seq_len=16, lr=3e-2, warmup_steps=0, schedule="constant")


def _program(config, rules="dp", mesh=None):
    mesh = mesh or make_mesh("", devices=jax.devices()[:1])
    return Program(config, get_rules(rules), mesh, optimizer=functools.partial(make_optimizer, SETTINGS),
                   batch_size=8, seq_len=16)


def _batch(seed, rows=8, length=16):
    """Rows counting up from a random start (learnable in a few steps), every token weighed."""
    ids = (np.random.default_rng(seed).integers(0, 64, (rows, 1)) + np.arange(length + 1)) % 64
    ones = np.ones((rows, length), np.int32)
    return {"inputs": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32),
            "positions": np.cumsum(ones, axis=1) - 1, "segment_ids": ones, "weights": ones.astype(np.float32)}


def _train(program, steps):
    state = program.init(np.asarray(jax.random.PRNGKey(0), np.uint32))
    start, losses = jax.device_get(state), []
    step = program.compiled_train_step()
    for i in range(steps):
        state, metrics = step(state, program.place(_batch(i)), np.zeros(2, np.uint32))
        losses.append(float(metrics["loss"]))
    return start, state, losses


@pytest.fixture(scope="module")
def lora_config(tiny_lm):
    return tiny_lm[1].replace(**LORA)


@pytest.fixture(scope="module")
def one_device(lora_config):
    """``(program, start, state, losses)`` of 6 LoRA steps on one device."""
    program = _program(lora_config)
    return (program, *_train(program, 6))


def test_only_adapters_train_and_the_adapted_model_starts_as_the_base(lora_config, one_device):
    program, start, state, losses = one_device

    flat_start = traverse_util.flatten_dict(start.params)
    flat_end = traverse_util.flatten_dict(jax.device_get(state.params))
    adapters = {k for k in flat_start if is_adapter(k)}
    assert len(adapters) == 14  # A and B on q, k, v, o, gate, up, down
    for key in flat_start:
        if key in adapters:
            assert not np.array_equal(flat_start[key], flat_end[key]), key  # trained
        else:
            assert np.array_equal(flat_start[key], flat_end[key]), key  # never recomputed
    # the optimizer state (Adam's mu and nu) exists for the adapters alone
    mu = state.opt_state[1][0].mu
    assert set(traverse_util.flatten_dict(mu)) == adapters
    assert program.plan().totals["gradients"] == sum(flat_start[k].nbytes for k in adapters)

    # at init B = 0: the adapted model's logits are the base model's (the same params, no adapters)
    base_config, base_params = lora_config.replace(lora_rank=0), split(start.params, is_adapter)[1]
    ids = _batch(99, rows=2)["inputs"]
    adapted = jax.jit(lambda p: lora_config.build().apply({"params": p}, ids))
    base = jax.jit(lambda p: base_config.build().apply({"params": p}, ids))
    np.testing.assert_allclose(adapted(start.params), base(base_params), rtol=0, atol=1e-6)
    assert losses[-1] < losses[0] - 0.1, losses
    # trained, the adapters change the logits, and the merged kernels compute the same ones
    params = jax.device_get(state.params)
    trained = adapted(params)
    assert float(np.max(np.abs(trained - base(base_params)))) > 1e-2
    np.testing.assert_allclose(base(merge_lora(lora_config, params)[1]), trained, rtol=0, atol=1e-5)


@pytest.mark.parametrize("rules, mesh", [("fsdp", "fsdp=8"), ("tp", "data=2,tensor=4")])
def test_lora_under_fsdp_and_tp_gives_the_one_device_losses(lora_config, one_device, rules, mesh):
    want = one_device[3][:3]
    program = _program(lora_config, rules, make_mesh(mesh))
    lora_a = program.shardings.params["layers"]["attn"]["q"]["lora_a"].spec
    lora_b = program.shardings.params["layers"]["attn"]["q"]["lora_b"].spec
    # A [layers, embed, lora_rank] shards like the kernel's input, B [layers, lora_rank, heads,
    # head_dim] like its outputs; the rank axis stays whole
    assert (lora_a[1], lora_b[2]) == (("fsdp", None) if rules == "fsdp" else (None, "tensor"))
    assert lora_a[2] is None and lora_b[1] is None
    _, _, got = _train(program, 3)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_lora_run_resumes_exactly_and_names_its_base(tmp_path):
    from shardzoo import cli
    from shardzoo.train.io.checkpoint import read_meta
    from shardzoo.train.io.sources import load_model_and_params

    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"text": "line {i} of a tiny corpus for a LoRA run"}}\n' for i in range(64)))
    flags = ["--model", "llama-tiny", "--override", "hidden_size=32", "--override", "num_hidden_layers=2",
             "--lora-rank", "4", "--lora-base-dtype", "bfloat16", "--data", str(data), "--batch-size", "8",
             "--seq-len", "16", "--save-every", "2", "--eval-every", "0", "--rules", "fsdp", "--mesh", "fsdp=8"]
    run = str(tmp_path / "run")
    assert cli.main(["train", *flags, "--out", run, "--steps", "4"]) == 0  # checkpoints 2 and 4
    _, config, want, _ = load_model_and_params(run)
    shutil.rmtree(os.path.join(run, "checkpoints", "4"))
    assert cli.main(["train", *flags, "--out", run, "--steps", "4"]) == 0  # resumes from step 2
    _, _, got, _ = load_model_and_params(run)
    assert config.param_dtype == "bfloat16" and config.lora_rank == 4
    flat_want, flat_got = traverse_util.flatten_dict(want), traverse_util.flatten_dict(got)
    for key, value in flat_want.items():  # one computation each way on one machine: exact
        assert value.dtype == (np.float32 if is_adapter(key) else jax.numpy.bfloat16), key
        np.testing.assert_array_equal(np.asarray(flat_got[key]), np.asarray(value), err_msg=str(key))
    meta = read_meta(os.path.join(run, "checkpoints"), 4)
    assert meta["lora"]["base"] == "llama-tiny" and meta["config"]["execution"]["lora_rank"] == 4

    # --init-from a LoRA run with the same adapters continues them (one step at lr 0 keeps them)
    more = str(tmp_path / "more")
    assert cli.main(["train", *flags, "--out", more, "--init-from", run, "--steps", "1", "--lr", "0"]) == 0
    flat_more = traverse_util.flatten_dict(load_model_and_params(more)[2])
    for key, value in flat_want.items():
        np.testing.assert_array_equal(np.asarray(flat_more[key]), np.asarray(value), err_msg=str(key))
