"""Pipeline parallelism (preset ``pp``, models/pipeline.py): 3 adamw steps of an 8-layer
llama-tiny equal one device's, stages exchange activations by collective-permute, and depths or
batches the schedule cannot split are one-line errors."""

import functools
import os
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardzoo.errors import UserError
from shardzoo.models import get_config
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.config import TrainConfig
from shardzoo.train.optim import make_optimizer
from shardzoo.train.program import Program

TINY = dict(hidden_size=32, intermediate_size=64, vocab_size=128, max_position_embeddings=32,
            num_hidden_layers=8)
BATCH, LENGTH, STEPS = 16, 16, 3
RULE_FILE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "pp_fsdp_tp.yaml")
OPTIMIZER = functools.partial(make_optimizer, TrainConfig(lr=1e-2, warmup_steps=0, steps=STEPS))


def _program(mesh, rules, **overrides):
    config = get_config("llama-tiny", **TINY, **overrides)
    return Program(config, rules, mesh, optimizer=OPTIMIZER, batch_size=BATCH, seq_len=LENGTH)


def _train(program):
    """STEPS steps of the program's compiled train step on one packed batch (two documents a row)."""
    rng = np.random.default_rng(0)
    rows = rng.integers(0, TINY["vocab_size"], (BATCH, LENGTH + 1))
    half = LENGTH // 2
    segments = np.repeat(np.array([[1] * half + [2] * (LENGTH - half)], np.int32), BATCH, 0)
    positions = np.repeat(np.concatenate([np.arange(half), np.arange(LENGTH - half)])[None], BATCH, 0)
    batch = program.place({"inputs": rows[:, :-1].astype(np.int32), "targets": rows[:, 1:].astype(np.int32),
                           "positions": positions.astype(np.int32), "segment_ids": segments,
                           "weights": (rng.random((BATCH, LENGTH)) > 0.1).astype(np.float32)})
    state, step = program.init(jax.random.key(0)), program.compiled_train_step()
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, batch, jax.random.PRNGKey(1))
        losses.append(float(metrics["loss"]))
    return np.array(losses), state, step.as_text()


@pytest.fixture(scope="module")
def reference():
    losses, _, _ = _train(_program(make_mesh("data=1", devices=jax.devices()[:1]), get_rules("dp")))
    assert losses[-1] < losses[0]  # the steps train
    return losses


def _stage_crossing_permutes(hlo: str, mesh) -> int:
    """collective-permutes whose every (source, target) pair joins devices of different stages."""
    stage_of = {int(d): i for d, i in zip(np.arange(mesh.size), np.indices(mesh.devices.shape)[
        mesh.axis_names.index("stage")].ravel(), strict=True)}
    count = 0
    for pairs in re.findall(r"collective-permute(?:-start)?\(.*source_target_pairs=\{(\{[^=]*\})\}", hlo):
        edges = [tuple(map(int, p.split(","))) for p in re.findall(r"\{(\d+,\d+)\}", pairs)]
        count += bool(edges) and all(stage_of[a] != stage_of[b] for a, b in edges)
    return count


# (mesh, rules, microbatches, repeats): microbatches 4 and 8 and repeats 1 and 2 each appear;
# the second case is circular with more microbatches than stages (the store delays them).
CASES = {
    "stage4": ("stage=4,data=2", "pp", 4, 1),
    "stage2_fsdp2_tensor2": ("stage=2,fsdp=2,tensor=2", RULE_FILE, 8, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pp_losses_match_one_device(reference, case):
    spec, rules, microbatches, repeats = CASES[case]
    mesh = make_mesh(spec)
    program = _program(mesh, get_rules(rules), pipeline_microbatches=microbatches, pipeline_repeats=repeats)
    losses, state, hlo = _train(program)
    np.testing.assert_allclose(losses, reference, rtol=0, atol=1e-5)
    q = state.params["layers"]["attn"]["q"]["kernel"]  # [layers, embed, heads, head_dim]
    want = P("stage", None, None, None) if rules == "pp" else P("stage", "fsdp", "tensor", None)
    assert q.sharding.is_equivalent_to(NamedSharding(mesh, want), q.ndim)
    assert q.addressable_shards[0].data.shape[0] == TINY["num_hidden_layers"] // mesh.shape["stage"]
    assert _stage_crossing_permutes(hlo, mesh) >= 1


def test_plan_shows_the_bubble_and_a_stage_share_of_the_layers():
    program = _program(make_mesh("stage=4,data=2"), get_rules("pp"), pipeline_microbatches=8,
                       pipeline_repeats=2)
    plan = program.plan(name="llama-tiny")
    pipe = plan.pipeline
    assert (pipe["stages"], pipe["microbatches"], pipe["repeats"], pipe["iterations"]) == (4, 8, 2, 19)
    assert pipe["bubble_fraction"] == pytest.approx(3 / 19)
    assert "bubble (S-1)/(RxM+S-1) = 3/19 = 15.8%" in plan.format()
    row = next(r for r in plan.params if r.array.path.endswith("layers/attn/q/kernel"))
    assert row.shard_shape[0] == 2  # 8 layers over 4 stages
    dp = _program(make_mesh("data=8"), get_rules("dp"))
    assert dp.plan().pipeline is None
    # the same parameter tree as without a pipeline: checkpoints and HF export move between them
    shapes = lambda p: jax.tree.map(lambda a: (a.shape, a.dtype), p.abstract.params)  # noqa: E731
    assert shapes(program) == shapes(dp)


@pytest.mark.parametrize("overrides, batch, message", [
    (dict(num_hidden_layers=6), BATCH,
     "num_hidden_layers=6 is not divisible by 4 pipeline stages x pipeline_repeats=1 (rules put layers "
     "on mesh axes stage)"),
    (dict(num_hidden_layers=12, pipeline_repeats=2), BATCH,
     "num_hidden_layers=12 is not divisible by 4 pipeline stages x pipeline_repeats=2"),
    (dict(pipeline_microbatches=2, pipeline_repeats=2), BATCH,
     "pipeline_microbatches=2 must be at least the 4 pipeline stages when pipeline_repeats=2"),
    (dict(pipeline_microbatches=8), 12, "batch of 12 rows is not divisible by pipeline_microbatches=8"),
    (dict(pipeline_microbatches=8), 8,
     "pipeline microbatch of 1 rows (batch 8 / pipeline_microbatches=8) is not divisible by the 2 devices"),
])
def test_depth_or_batch_the_schedule_cannot_split_is_one_line(overrides, batch, message):
    config = get_config("llama-tiny", **{**TINY, **overrides})
    with pytest.raises(UserError) as err:
        Program(config, get_rules("pp"), make_mesh("stage=4,data=2"), optimizer=OPTIMIZER,
                batch_size=batch, seq_len=LENGTH)
    assert message in str(err.value) and "\n" not in str(err.value)
