"""``shardzoo train`` over two processes on 127.0.0.1 (4 fake CPU devices each, 8 in all) trains
exactly like one process on 8 devices: same losses under fsdp and dp, each process supplying its
own half of every global batch, logging from process 0 only, and a checkpoint written by the two
processes resuming in one process.

Three runs start together (one-process fsdp reference, two-process fsdp, two-process dp); the
resume run starts from the two-process fsdp run's step-3 checkpoint.
"""

import json
import shutil

import pytest

from shardzoo.train.metrics import read_metrics

STEPS = 5
RUN = ["--steps", str(STEPS), "--save-every", "3", "--keep", "5"]
TOL = 1e-5  # float32; measured differences are ~5e-7
MESHES = {"fsdp": "fsdp=8", "dp": "data=8"}


def _flags(rules: str) -> list[str]:
    return [*RUN, "--rules", rules, "--mesh", MESHES[rules]]


def _losses(out) -> dict[int, float]:
    records = read_metrics(out / "metrics.jsonl")
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == sorted(set(steps)), f"duplicate or unordered steps in metrics.jsonl: {steps}"
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _rows(prefix, process: int) -> list[dict]:
    with open(f"{prefix}.p{process}.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(runner):
    """{name: out dir} of the finished runs "single" (fsdp, 1 process), "fsdp" and "dp" (2 each)."""
    root = runner.root
    procs = {"single": [runner.start("single", root / "single", *_flags("fsdp"), rows=root / "single.rows")]}
    for rules in MESHES:
        procs[rules] = runner.start_pair(rules, root / rules, *_flags(rules), rows=root / f"{rules}.rows")
    runner.finish([p for group in procs.values() for p in group], timeout=600)
    for name, group in procs.items():
        for i, p in enumerate(group):
            log_name = name if name == "single" else f"{name}.{i}"
            assert p.returncode == 0, f"{log_name} exited {p.returncode}:\n{runner.log(log_name)[-3000:]}"
    return {name: root / name for name in procs}


@pytest.mark.parametrize("rules", list(MESHES))
def test_two_processes_train_like_one(runs, rules):
    """Per-step losses of the two-process run equal the one-process 8-device fsdp run's."""
    want, got = _losses(runs["single"]), _losses(runs[rules])
    assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=TOL), f"step {step}"
    assert want[STEPS] < want[1]  # it learned something: the comparison is not of constants
    run = json.loads((runs[rules] / "run.json").read_text())
    assert (run["processes"], run["devices"]) == (2, 8)


@pytest.mark.parametrize("rules", list(MESHES))
def test_each_process_supplies_its_half_of_every_batch(runner, runs, rules):
    """Process 0 hands JAX rows 0-3 and process 1 rows 4-7 of each global batch the one-process
    run reads (8 distinct rows), never the whole batch."""
    root = runner.root
    single = _rows(root / "single.rows", 0)[:STEPS]
    halves = [_rows(root / f"{rules}.rows", i)[:STEPS] for i in (0, 1)]
    assert len(single) == len(halves[0]) == len(halves[1]) == STEPS
    for step, (whole, first, second) in enumerate(zip(single, *halves, strict=True), start=1):
        assert whole["shape"] == [8, 16] and first["shape"] == second["shape"] == [4, 16]
        assert len(set(whole["rows"])) == 8, f"step {step}: rows repeat, disjointness is untested"
        assert first["rows"] + second["rows"] == whole["rows"], f"step {step}"


@pytest.mark.parametrize("rules", list(MESHES))
def test_only_process_zero_logs(runner, runs, rules):
    """The plan, the progress lines and metrics.jsonl come from process 0; process 1 is silent."""
    zero, one = runner.log(f"{rules}.0"), runner.log(f"{rules}.1")
    for text in ("rule table", "step 1:", f"step {STEPS}:", "stopped at step"):
        assert text in zero
        assert text not in one


@pytest.fixture(scope="module")
def resumed(runner, runs):
    """The two-process fsdp run cut back to its step-3 checkpoint, resumed to step 5 by one
    process on 8 devices: (out dir, log)."""
    out = runner.root / "resumed"
    shutil.copytree(runs["fsdp"], out)
    shutil.rmtree(out / "checkpoints" / str(STEPS))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["3"]
    proc = runner.start("resumed", out, *_flags("fsdp"))
    runner.finish([proc], timeout=300)
    log = runner.log("resumed")
    assert proc.returncode == 0, log[-3000:]
    return out, log


def test_two_process_checkpoint_resumes_in_one_process(runs, resumed):
    """Steps 4 and 5 after restoring the two-process step-3 checkpoint on one process equal the
    uninterrupted one-process run's."""
    out, log = resumed
    assert f"resumed from {out}/checkpoints/3" in log
    assert "step 3:" not in log and "step 4:" in log  # it continued, it did not start over
    want, got = _losses(runs["single"]), _losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in (4, 5):
        assert got[step] == pytest.approx(want[step], abs=TOL), f"step {step}"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["3", "5"]
