"""The sharding plan: per-device bytes by hand and against the compiler, abstract meshes, JSON."""

import json

import jax
import pytest
from jax.sharding import AbstractMesh, Mesh

from shardzoo.errors import UserError
from shardzoo.models import get_config
from shardzoo.sharding import (
    get_rules,
    make_mesh,
    parse_device_memory,
    planning_mesh,
)
from shardzoo.sharding.activations import shards
from shardzoo.train.config import TrainConfig
from shardzoo.train.program import plan
from shardzoo.train.tasks.registry import run_program

# Big enough that parameters dominate the step's arguments (825,352 params vs a 16x64 batch).
BIG = get_config("mlp-tiny", in_features=64, width=512, depth=4, num_outputs=8)


def test_fsdp_holds_an_eighth_of_dp_and_agrees_with_the_compiler():
    dp = plan(BIG, "dp", "data=8", batch_size=16)
    fsdp = plan(BIG, "fsdp", "fsdp=8", batch_size=16)
    state = lambda p: p.totals["params"] + p.totals["optimizer"]
    # adamw's mu and nu (float32) plus a few int32 step counts (adam's, the schedule's)
    assert dp.totals["params"] == 4 * 825_352
    assert 8 * 825_352 < dp.totals["optimizer"] <= 8 * 825_352 + 4 * 4
    # Only the unsharded biases (mlp, vocab) keep fsdp above exactly 1/8: within 2%.
    assert abs(state(fsdp) / (state(dp) / 8) - 1) < 0.02
    program = run_program(TrainConfig(batch_size=16), BIG, get_rules("fsdp"), make_mesh("fsdp=8"))
    result = program.compile_report()
    # XLA's per-device arguments are params + optimizer state (+ the step count) + the batch
    # shard (inputs 64 floats, target and weight per row). Measured 3e-6 apart: held to 1%.
    compiled_state = result["memory"]["argument"] - result["batch_bytes"]
    assert result["batch_bytes"] == (16 // 8) * (64 + 2) * 4
    assert abs(compiled_state / state(fsdp) - 1) < 0.01
    assert result["collectives"]["all-gather"] > 0


def test_256_device_plan_needs_no_devices_and_sums_sharded_sizes():
    config = get_config("mlp-tiny", in_features=256, width=512, depth=2, num_outputs=64)
    p = plan(config, "fsdp_tp", "fsdp=32,tensor=8", batch_size=256, device_memory="h100")
    assert jax.device_count() == 8 and p.abstract_mesh and p.mesh["fsdp"] == 32
    rows = {r.array.path: r for r in p.params}
    # By hand: embed over fsdp=32, mlp and vocab over tensor=8, 4 bytes each.
    expected = {
        "params/layers_0/kernel": (8, 64),  # (256, 512) as (embed, mlp)
        "params/layers_0/bias": (64,),  # (512,) mlp
        "params/layers_1/kernel": (64, 16),  # (512, 512) as (mlp, embed)
        "params/layers_1/bias": (16,),  # (512,) embed
        "params/head/kernel": (16, 8),  # (512, 64) as (embed, vocab)
        "params/head/bias": (8,),  # (64,) vocab
    }
    assert {k: r.shard_shape for k, r in rows.items()} == expected
    by_hand = 4 * (8 * 64 + 64 + 64 * 16 + 16 + 16 * 8 + 8)
    assert by_hand == 7008 == p.totals["params"] == p.totals["gradients"]
    assert p.totals["optimizer"] == 2 * by_hand + 2 * 4  # adamw mu, nu + two int32 counts
    assert p.fits and p.to_dict()["device_memory"]["bytes"] == 80_000_000_000


def test_mlp_activation_estimate_by_hand():
    config = get_config("mlp-tiny")  # 16 -> 32 -> 32 -> 4, float32
    p = plan(config, "tp", "data=2,tensor=4", batch_size=16)
    # input (batch/2, 16); layer 0 (batch/2, mlp/4) and layer 1 (batch/2, 32), pre+post
    # activation each; logits (batch/2, vocab/4) in float32 twice.
    by_hand = 8 * 16 * 4 + 8 * 8 * 2 * 4 + 8 * 32 * 2 * 4 + 8 * 1 * 8
    assert p.totals["activations"] == by_hand == 3136


def test_plan_json_and_table_show_winners_and_losers():
    config = get_config("mlp-tiny")
    p = plan(config, "fsdp", "fsdp=8", batch_size=16, name="mlp-tiny")
    data = json.loads(p.to_json())
    assert data["num_devices"] == 8 and data["rules"]["name"] == "fsdp"
    kernel = next(r for r in data["params"] if r["path"] == "params/layers_0/kernel")
    assert kernel["spec"] == [["fsdp"], None] and kernel["shard_shape"] == [2, 32]
    assert kernel["dims"][0]["rule"] == "#1 embed->fsdp" and kernel["dims"][0]["lost"] == []
    assert sum(r["bytes_per_device"] for r in data["params"]) == data["totals"]["params"]
    act = next(r for r in data["activations"] if r["path"] == "activations/MLP#0")
    assert act["dims"][1]["lost"] == [{"rule": "#1 embed->fsdp", "taken": ["fsdp"]}]
    assert act["dims"][1]["rule"] == "#4 embed->null"
    table = p.format()
    assert "params/layers_0/kernel" in table and "embed:fsdp #1" in table
    assert "activations/MLP#0 dim 1 (embed): #1 embed->fsdp (fsdp taken)" in table


def test_device_memory_and_planning_mesh():
    assert parse_device_memory("80GB")[1] == 80 * 10**9
    assert parse_device_memory("16GiB")[1] == 16 * 2**30
    assert parse_device_memory("h200")[1] == 141 * 10**9
    assert parse_device_memory("v5e")[1] == 16 * 10**9
    with pytest.raises(UserError, match="lots"):
        parse_device_memory("lots")
    assert isinstance(planning_mesh("data=-1"), Mesh)
    assert isinstance(planning_mesh("data=2,tensor=4"), Mesh)
    assert isinstance(planning_mesh("fsdp=32,tensor=8"), AbstractMesh)
    assert isinstance(planning_mesh("data=2"), AbstractMesh)  # 2 != the 8 local devices
    config = get_config("mlp-tiny")
    small = plan(config, "dp", "data=8", batch_size=8, device_memory="1kB")
    assert small.fits is False and "DOES NOT FIT" in small.format()


def test_llama3_8b_on_256_devices():
    config = get_config("llama3-8b")
    p = plan(config, "fsdp_tp", "fsdp=32,tensor=8", batch_size=256, seq_len=4096,
             device_memory="h100")
    assert p.abstract_mesh and p.totals["param_count"] == 8_030_261_248
    rows = {r.array.path: r for r in p.params}
    assert rows["params/embed/embedding"].shard_shape == (128256 // 8, 4096 // 32)
    assert rows["params/layers/mlp/gate/kernel"].shard_shape == (32, 4096 // 32, 14336 // 8)
    assert rows["params/layers/attn/k/kernel"].shard_shape == (32, 4096 // 32, 1, 128)
    # By hand: every matrix splits 256 ways (embed over 32, the other dim over 8); the norms
    # (embed only) 32 ways. Float32 parameters.
    d, f, kv, v, n = 4096, 14336, 8 * 128, 128256, 32
    matrices = n * (2 * d * d + 2 * d * kv + 3 * d * f) + 2 * v * d
    norms = n * 2 * d + d
    assert p.totals["params"] == 4 * (matrices // 256 + norms // 32)
    assert 2 * p.totals["params"] <= p.totals["optimizer"] <= 2 * p.totals["params"] + 16
    # Without remat, float32 activations of 256 x 4096 tokens (~260 GB a device) do not fit an
    # H100; remat full in bfloat16 keeps each layer's input (32 x 0.27 GB), one layer
    # recomputed and its backward (~7.5 GB each) and the head (~3.7 GB), and does.
    assert not p.fits and p.totals["activations"] > 200e9
    light = config.replace(remat_policy="full", dtype="bfloat16")
    fitting = plan(light, "fsdp_tp", "fsdp=32,tensor=8", batch_size=256, seq_len=4096,
                   device_memory="h100")
    assert fitting.fits and fitting.totals["activations"] < 30e9
    # Saved activations shrink with rematerialisation, in the documented order.
    mesh, rules = planning_mesh("fsdp=32,tensor=8"), get_rules("fsdp_tp")
    est = {
        pol: config.replace(remat_policy=pol).activation_estimate(
            256, 4096, lambda names: shards(names, rules, mesh)).bytes
        for pol in ("none", "dots_saveable", "dots_with_no_batch_dims_saveable",
                    "save_attn_mlp", "full")
    }
    assert p.totals["activations"] == est[config.remat_policy]
    assert est["none"] > est["dots_saveable"] > est["dots_with_no_batch_dims_saveable"]
    assert est["dots_with_no_batch_dims_saveable"] > est["save_attn_mlp"] > est["full"]
    # remat "full" keeps each layer's input [batch/32, length, embed] (float32), plus one
    # recomputed layer and the logits, which are less than all layers' activations.
    block_input = 256 // 32 * 4096 * d * 4
    assert n * block_input < est["full"] < n * block_input + est["none"]


@pytest.mark.parametrize("rules, mesh", [("fsdp", "fsdp=8"), ("tp", "data=4,tensor=2"), ("cp", "context=4,data=2")])
def test_plan_total_within_15_percent_of_the_compiled_step(rules, mesh):
    """The plan's per-device total (params + gradients + optimizer + the model's activation
    estimate) against XLA's total for the step ``shardzoo train`` runs (llama-tiny, 16 x 64).
    Measured 1.00 (fsdp) and 1.05 (tp); the estimate before it counted what XLA keeps: 0.7.
    cp: ring attention (bench/bench_context.py checks its estimate at 4096 tokens)."""
    config = get_config("llama-tiny")
    program = run_program(TrainConfig(batch_size=16, seq_len=64), config, get_rules(rules), make_mesh(mesh))
    planned = program.plan().totals["total"]
    compiled = program.compile_report()["memory"]["total"]
    assert 0.85 < planned / compiled < 1.15, (planned, compiled)


@pytest.mark.parametrize("name", ["deepseek-v2-tiny", "deepseek-v3-tiny"])
def test_latent_attention_plan_within_15_percent_of_the_compiled_step(name):
    """Multi-head latent attention (16 x 64, fsdp=8): the plan's total against XLA's, and its
    temporaries (activations + gradients) against XLA's temp. The latents (kv_lora + q_lora per
    token, and their float32 norms) are counted; without them deepseek-v2-tiny's activations were
    0.88 of what XLA keeps beside the gradients, with them 0.99 (v3-tiny 0.93 -> 0.98)."""
    config = get_config(name)
    program = run_program(TrainConfig(batch_size=16, seq_len=64), config, get_rules("fsdp"), make_mesh("fsdp=8"))
    totals, memory = program.plan().totals, program.compile_report()["memory"]
    assert 0.85 < totals["total"] / memory["total"] < 1.15, (totals, memory)
    temp = totals["activations"] + totals["gradients"]
    assert 0.85 < temp / memory["temp"] < 1.15, (temp, memory)
    terms = config.activation_estimate(16, 64, lambda names: 1).terms
    assert terms["latent"] > 0 and terms["latent_norm"] == 3 * terms["latent"]  # a float32 model


@pytest.mark.parametrize("rules, mesh", [("fsdp", "fsdp=8"), ("ep", "expert=4,data=2")])
def test_gpt_oss_plan_within_15_percent_of_the_compiled_step(rules, mesh):
    """gpt-oss-tiny (attention sinks, sliding and full layers scanned in periods of 2, biased
    experts with the clamped SwiGLU, indexed dispatch), 16 x 64: the plan's total against XLA's,
    and its temporaries (activations + gradients) against XLA's temp. Measured 0.94 / 0.94 (fsdp)
    and 0.99 / 0.99 (ep); without counting the clamps' three expert buffers, 0.76 under fsdp."""
    config = get_config("gpt-oss-tiny")
    program = run_program(TrainConfig(batch_size=16, seq_len=64), config, get_rules(rules), make_mesh(mesh))
    totals, memory = program.plan().totals, program.compile_report()["memory"]
    assert 0.85 < totals["total"] / memory["total"] < 1.15, (totals, memory)
    temp = totals["activations"] + totals["gradients"]
    assert 0.85 < temp / memory["temp"] < 1.15, (temp, memory)
    clamp = config.replace(swiglu_limit=None).activation_estimate(16, 64, lambda names: 1).bytes
    assert clamp < config.activation_estimate(16, 64, lambda names: 1).bytes  # the clamps are counted
