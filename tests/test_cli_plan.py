"""``shardzoo plan`` on the command line: table, JSON, --compile, and one-line errors (status 2)."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from shardzoo.cli import main
from shardzoo.data.packing import Documents, batch_arrays, pack_documents
from shardzoo.models import get_config, get_model
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.config import TrainConfig
from shardzoo.train.jit import count_collectives, memory_analysis
from shardzoo.train.tasks.registry import run_program
from shardzoo.train.trainer import Trainer

TINY = ["plan", "--model", "mlp-tiny"]


def _run(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_table(capsys):
    status, out, err = _run(capsys, *TINY, "--rules", "fsdp", "--mesh", "fsdp=8",
                            "--device-memory", "v5e")
    assert status == 0 and err == ""
    assert "plan for mlp-tiny: rules 'fsdp' on mesh fsdp=8 (8 devices" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("params/layers_0/kernel"))
    assert "(16, 32)" in line and "embed:fsdp #1" in line and "(2, 32)" in line
    assert "device v5e (16 GB): fits" in out


def test_rules_default_as_trains_and_only_the_models_axes_are_listed(capsys):
    """Without --rules, plan takes train's default (fsdp on more than one device, dp on one); the
    rules line names only the logical axes the model has, each rule that decides one once."""
    status, out, err = _run(capsys, "plan", "--model", "llama-tiny", "--mesh", "fsdp=8")
    assert status == 0 and err == "", err
    assert "rules 'fsdp' on mesh fsdp=8" in out
    rules = " ".join(line for line in out.split("\n\n")[0].splitlines()[2:])
    assert "#0 batch->data,fsdp" in rules and "batch->null" not in rules, rules
    assert "ssm_" not in rules and "linear_" not in rules and "#11 layers->null" in rules, rules
    status, out, _ = _run(capsys, "plan", "--model", "llama-tiny", "--mesh", "data=1")
    assert status == 0 and "rules 'dp' on mesh one device" in out, out


def test_the_header_states_the_workload_and_the_verdict_is_asked_for(capsys):
    """plan says what it plans (batch, sequence, dtypes, remat), keeps each rule whole on its
    line, names only the mesh axes that split, and without a device memory (and no accelerator
    here) says how to get a fits verdict."""
    status, out, _ = _run(capsys, "plan", "--model", "llama-tiny", "--rules", "fsdp_tp", "--mesh", "fsdp=4,tensor=2",
                          "--batch-size", "8", "--seq-len", "64", "--override", "remat_policy=full")
    lines = out.splitlines()
    assert status == 0 and "on mesh fsdp=4,tensor=2 (8 devices" in lines[0]
    assert lines[1] == "workload: batch 8, sequence 64, compute float32, params float32, remat full"
    rules = [x for x in lines[2:] if x.startswith(("rules: ", "       #"))]
    assert rules and all(len(x) <= 100 for x in rules)
    for x in rules:  # every entry whole: '#N name->axes'
        for entry in x.removeprefix("rules: ").strip().split("  "):
            assert re.fullmatch(r"#\d+ \w+->[\w,]+", entry.strip()), entry
    assert "no device memory named and no accelerator here: add --device-memory" in out


def test_json_with_overrides_and_a_256_device_mesh(capsys):
    status, out, _ = _run(capsys, *TINY, "--override", "width=64", "--override", "num_outputs=8",
                          "--override", "in_features=64",
                          "--rules", "fsdp_tp", "--mesh", "fsdp=32,tensor=8",
                          "--batch-size", "256", "--json")
    assert status == 0
    data = json.loads(out)
    assert data["abstract_mesh"] and data["num_devices"] == 256 and data["batch_size"] == 256
    rows = {r["path"]: r for r in data["params"]}
    assert rows["params/layers_1/kernel"]["shape"] == [64, 64]
    assert rows["params/layers_1/kernel"]["shard_shape"] == [8, 2]  # (mlp/8, embed/32)
    assert data["totals"]["params"] == sum(r["bytes_per_device"] for r in data["params"])
    assert data["compile"] is None


def test_compile_reports_memory_and_collectives(capsys):
    status, out, _ = _run(capsys, *TINY, "--rules", "fsdp", "--mesh", "fsdp=8", "--compile", "--json")
    assert status == 0
    data = json.loads(out)
    memory, totals = data["compile"]["memory"], data["totals"]
    # Independently: the per-device bytes of the sharded train state that Program.init really
    # creates (every shard of every array, over the 8 devices).
    program = run_program(TrainConfig(batch_size=8, seq_len=2048), get_config("mlp-tiny"),
                          get_rules("fsdp"), make_mesh("fsdp=8"))
    state = program.init(jax.random.PRNGKey(0))
    created = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards) // 8
    # The plan's params + optimizer state is that state less its step counter (int32).
    assert totals["params"] + totals["optimizer"] + 4 == created
    # XLA's arguments: that state and this device's batch shard: 1 of the 8 rows, 16 float32
    # features, an int32 label and a float32 weight (the rng key is dead: mlp-tiny has no
    # dropout, and XLA does not count it).
    assert memory["argument"] == created + 1 * (16 + 1 + 1) * 4
    assert data["compile"]["batch_bytes"] == (16 + 1 + 1) * 4
    # Parameters are gathered for the forward pass under fsdp; dp gathers nothing.
    assert data["compile"]["collectives"]["all-gather"] > 0
    status, out, _ = _run(capsys, *TINY, "--rules", "dp", "--mesh", "data=8", "--compile")
    assert status == 0 and "compiled train step" in out and "arguments" in out
    collectives = dict(re.findall(r"([a-z-]+) (\d+)", out.split("collectives: ")[1]))
    assert collectives["all-gather"] == "0" and int(collectives["all-reduce"]) > 0


class PackedBatches:
    """Batches of really packed documents (data/packing.py): several documents per row, so
    segment ids change inside rows, positions restart, and weights are 0 at their seams."""

    def __init__(self, batch_size, seq_len, vocab=300, pad_id=0):
        rng = np.random.default_rng(0)
        lengths = rng.integers(3, seq_len // 2, 8 * batch_size)
        tokens = rng.integers(1, vocab, int(lengths.sum())).astype(np.int32)
        docs = Documents(tokens, np.concatenate([[0], np.cumsum(lengths)]), np.ones(len(tokens), bool))
        self.rows, self.pad_id = pack_documents(docs, seq_len, pad_id), pad_id
        self.batch_size, self.position = batch_size, 0

    def __iter__(self):
        return self

    def __next__(self):
        indices = np.arange(self.position, self.position + self.batch_size) % len(self.rows.tokens)
        self.position += self.batch_size
        return batch_arrays(self.rows, indices, self.pad_id)

    def state(self):
        return {"position": self.position}

    def restore(self, state):
        self.position = state["position"]


def _compiled_facts(compiled) -> tuple[dict, dict]:
    return memory_analysis(compiled), count_collectives(compiled.as_text())


def test_plan_compile_is_the_step_the_trainer_runs(capsys, tmp_path):
    """fsdp_tp with packed data, loss weights and 2 microbatches: the Trainer's compiled step
    and ``plan --compile``'s have the same memory analysis and collective counts."""
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    args = ["plan", "--model", "llama-tiny", "--rules", "fsdp_tp", "--mesh", "fsdp=4,tensor=2",
            "--batch-size", "16", "--seq-len", "32", "--compile", "--json",
            *(x for k, v in small.items() for x in ("--override", f"{k}={v}"))]
    module, config = get_model("llama-tiny", **small)
    batch = next(PackedBatches(16, 32))
    assert batch["segment_ids"].max() > 1 and 0 < batch["weights"].mean() < 1  # packed, weighted
    cfg = TrainConfig(batch_size=16, seq_len=32, grad_accum=2, steps=1, out=str(tmp_path))
    trainer = Trainer(module, config, cfg, make_mesh("fsdp=4,tensor=2"), get_rules("fsdp_tp"), PackedBatches(16, 32))
    step = trainer.program.compiled_train_step()
    memory, collectives = _compiled_facts(step)
    _, metrics = step(trainer.state, trainer.program.place(batch), trainer.rng)  # runs on it
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    status, out, _ = _run(capsys, *args, "--grad-accum", "2")
    assert status == 0
    planned = json.loads(out)["compile"]
    assert planned["memory"] == memory and planned["collectives"] == collectives
    # The comparison tells steps apart: without --grad-accum 2 it is another program.
    status, out, _ = _run(capsys, *args)
    assert status == 0 and json.loads(out)["compile"]["memory"] != memory


def test_compile_refuses_a_mesh_larger_than_the_machine(capsys):
    status, _, err = _run(capsys, *TINY, "--rules", "dp", "--mesh", "data=16", "--compile")
    assert status == 2 and "--compile needs the mesh's 16 devices" in err


@pytest.mark.parametrize(
    "args, words",
    [
        (["--rules", "zero9", "--mesh", "fsdp=8"], ["unknown rule preset 'zero9'"]),
        (["--rules", "fsdp", "--mesh", "fsdp=eight"], ["mesh spec", "'eight'"]),
        (["--rules", "fsdp", "--mesh", "fsdp=2,model=4"], ["unknown mesh axis 'model'"]),
        (["--rules", "fsdp", "--mesh", "fsdp=8", "--override", "width=x"], ["width"]),
        (["--rules", "fsdp", "--mesh", "fsdp=8", "--device-memory", "big"], ["'big'"]),
    ],
)
def test_user_errors_are_one_line_with_status_2(capsys, args, words):
    status, out, err = _run(capsys, *TINY, *args)
    assert status == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("shardzoo plan: error: ")
    for w in words:
        assert w in err


def test_rule_file_with_an_unknown_mesh_axis(capsys, tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("base: tp\nrules:\n  - [embed, fsdpp]\n")
    status, _, err = _run(capsys, *TINY, "--rules", str(path), "--mesh", "data=8")
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert "'fsdpp'" in err and "typo.yaml" in err
    status, out, _ = _run(capsys, *TINY, "--rules", str(path), "--mesh", "data=8", "--non-strict")
    assert status == 0 and "warning: rule table" in out


def test_several_problems_are_listed_one_a_line(capsys):
    status, out, err = _run(capsys, *TINY, "--rules", "tp", "--mesh", "tensor=8")
    lines = err.strip().splitlines()
    assert status == 2 and out == "" and len(lines) == 4
    assert lines[0] == "shardzoo plan: error: 3 sharding problems [--non-strict makes these warnings]:"
    assert all("size 4 is not divisible by mesh axes tensor=8" in line for line in lines[1:])


# A hand-written table with a typo in a mesh axis, which also forgets `vocab`.
TYPO_RULES = """\
- [batch, [data, fsdp]]
- [embed, fsdp]
- [mlp, bogusaxis]
"""


def test_rule_file_typo_is_listed_first_with_every_other_problem(capsys, tmp_path):
    from shardzoo.models import get_config
    from shardzoo.sharding import ShardingValidationError
    from shardzoo.train.program import plan

    path = tmp_path / "typo.yaml"
    path.write_text(TYPO_RULES)
    status, out, err = _run(capsys, *TINY, "--rules", str(path), "--mesh", "fsdp=8")
    lines = err.strip().splitlines()
    assert status == 2 and out == "" and "Traceback" not in err
    assert lines[0].startswith("shardzoo plan: error: 2 sharding problems")
    assert "rule #2 mlp->bogusaxis names mesh axis 'bogusaxis'" in lines[1] and "typo.yaml" in lines[1]
    assert "logical axis 'vocab' has no rule" in lines[2]
    config = get_config("mlp-tiny")
    with pytest.raises(ShardingValidationError) as e:
        plan(config, str(path), "fsdp=8", batch_size=8)
    assert [line.strip() for line in lines[1:]] == [p.message for p in e.value.problems]


def test_entry_point_in_a_subprocess(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one local device: the 64-device mesh is planned abstractly
    proc = subprocess.run(
        [sys.executable, "-m", "shardzoo", *TINY, "--override", "in_features=32",
         "--rules", "fsdp", "--mesh", "data=2,fsdp=32",
         "--batch-size", "64", "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["abstract_mesh"] and data["mesh"]["fsdp"] == 32
    kernel = next(r for r in data["params"] if r["path"] == "params/layers_0/kernel")
    assert kernel["shard_shape"] == [1, 32]  # (embed 32 over fsdp=32, mlp)


def test_missing_flag_is_argparse_status_2(capsys):
    with pytest.raises(SystemExit) as e:
        main([*TINY, "--rules", "fsdp"])
    assert e.value.code == 2 and "--mesh" in capsys.readouterr().err
