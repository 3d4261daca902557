"""A resume is checked against the run before anything is written: a refused one leaves the
directory byte-identical; --steps at or below the saved step has nothing to do; train --out
refuses files that are not a shardzoo run's; read-only and misshapen run directories fail in
one line."""

import subprocess

import pytest

from shardzoo.cli import main


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """A tiny byte-level BPE tokenizer.json (300 ids, fits llama-tiny's 512)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


REFUSED = {  # flags -> what the one line must say
    "tokenizer": (["--tokenizer", "{tok}"], "was trained with --tokenizer byte"),
    "seq_len": (["--seq-len", "32"], "was trained with --seq-len 16, not 32"),
    "batch_size": (["--batch-size", "16"], "was trained with --batch-size 8, not 16"),
    "model": (["--model", "gpt2-tiny"], "holds model 'llama-tiny', not 'gpt2-tiny'"),
    "override": (["--override", "intermediate_size=128"], "intermediate_size=64"),
    "optimizer": (["--optimizer", "sgd"], "was trained with --optimizer adamw, not sgd"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_resume_leaves_the_run_byte_identical(cli, run_copy, other_tokenizer, case, capsys):
    flags, expected = REFUSED[case]
    before = cli.snapshot(run_copy)
    capsys.readouterr()
    rc = main(cli.args(run_copy, 12, *[f.format(tok=other_tokenizer) for f in flags]))
    line = cli.one_line(capsys.readouterr().err)
    assert rc == 2 and expected in line, line
    assert cli.snapshot(run_copy) == before


@pytest.mark.parametrize("steps", [4, 8])
def test_steps_at_or_below_the_saved_step_has_nothing_to_do(cli, run_copy, steps, capsys):
    before = cli.snapshot(run_copy)
    capsys.readouterr()
    assert main(cli.args(run_copy, steps)) == 0
    captured = capsys.readouterr()
    assert f"is at step 8 and --steps is {steps}: nothing to do" in captured.out
    assert captured.err == ""
    assert cli.snapshot(run_copy) == before


@pytest.mark.parametrize("name", ["metrics.jsonl", "run.json"])
def test_train_refuses_an_out_holding_someone_elses_files(cli, tmp_path, name, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / name).write_text('{"my": "own results"}\n')
    (out / "notes.txt").write_text("mine\n")
    before = cli.snapshot(out)
    capsys.readouterr()
    rc = main(cli.args(out, 4))
    line = cli.one_line(capsys.readouterr().err)
    assert rc == 2 and f"holds {name} but is not a shardzoo run" in line, line
    assert cli.snapshot(out) == before


def test_a_checkpoints_path_that_is_a_file_is_caught_before_training(cli, tmp_path, capsys):
    out = tmp_path / "odd"
    out.mkdir()
    (out / "checkpoints").write_text("not a directory\n")
    before = cli.snapshot(out)
    capsys.readouterr()
    rc = main(cli.args(out, 4))
    line = cli.one_line(capsys.readouterr().err)
    assert rc == 2 and "checkpoints exists and is not a directory" in line, line
    assert cli.snapshot(out) == before and sorted(p.name for p in out.iterdir()) == ["checkpoints"]


def test_a_read_only_out_exits_2_and_changes_nothing(cli, run_copy, unshare):
    """--out on a read-only bind mount (a private mount namespace)."""
    before = cli.snapshot(run_copy)
    argv = " ".join(cli.cmd(*cli.args(run_copy, 12))[:2]) + " \"$LAUNCHER\" " + " ".join(
        map(str, cli.args(run_copy, 12)))
    script = f"mount --bind -o ro {run_copy} {run_copy} && exec {argv}"
    done = subprocess.run([*unshare, script], env=cli.env(LAUNCHER=cli.cmd()[2]), capture_output=True,
                          text=True, timeout=300)
    line = cli.one_line(done.stderr)
    assert done.returncode == 2 and f"--out {run_copy} is not writable: Read-only file system" in line
    assert cli.snapshot(run_copy) == before
