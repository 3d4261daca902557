"""Bad values, files and targets end in one line with exit status 2, naming what to change, and
write nothing: config fields, generate's flags, HF files, export and plot targets, data files."""

import os
import subprocess
import time

import pytest

from shardzoo.cli import main


@pytest.mark.parametrize("override, expected", [
    ("hidden_size=-64", "hidden_size=-64 must be a positive integer"),
    ("rope_scaling=5", "rope_scaling=5 is not a mapping"),
    ("num_hidden_layers=0", "num_hidden_layers=0 must be a positive integer"),
    # values that make the math non-finite are refused as configs, not at step 1
    ("initializer_range=nan", "initializer_range=nan must be a finite number > 0"),
    ("rms_norm_eps=-1", "rms_norm_eps=-1.0 must be a finite number > 0"),
    ("rope_theta=0", "rope_theta=0.0 must be a finite number > 0"),
    ("head_dim=15", "rotary embeddings turn pairs of features: head_dim=15"),
    ("hiden_size=128", "unknown override hiden_size (did you mean hidden_size?)"),
])
def test_a_bad_config_field_is_refused_at_construction(cli, tmp_path, override, expected, capsys):
    out = tmp_path / "never"
    capsys.readouterr()
    rc = main(cli.args(out, 4, "--override", override))
    line = cli.one_line(capsys.readouterr().err)
    assert rc == 2 and expected in line, line
    assert not out.exists()


@pytest.mark.parametrize("flags, expected", [
    (["--temperature", "nan"], "--temperature nan must be a finite number >= 0"),
    (["--temperature", "-1"], "--temperature -1 must be a finite number >= 0"),
    (["--top-p", "0"], "--top-p 0 must be in (0, 1]"),
])
def test_generate_refuses_values_that_give_garbage(cli, reference, flags, expected, capsys):
    capsys.readouterr()
    rc = main(["generate", "--checkpoint", str(reference), "--prompt", "the", *flags])
    line = cli.one_line(capsys.readouterr().err, "generate")
    assert rc == 2 and expected in line, line


@pytest.fixture
def hf_dir(reference, tmp_path):
    path = tmp_path / "hf"
    assert main(["export-hf", str(reference), str(path)]) == 0
    return path


def test_import_hf_of_a_truncated_safetensors_file(cli, hf_dir, tmp_path, capsys):
    weights = hf_dir / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    capsys.readouterr()
    rc = main(["import-hf", str(hf_dir), str(tmp_path / "imported")])
    line = cli.one_line(capsys.readouterr().err, "import-hf")
    assert rc == 2 and f"{weights}" in line and "truncated or damaged?" in line, line
    assert not (tmp_path / "imported").exists()


def test_export_hf_refuses_a_non_empty_target_unless_overwrite(cli, reference, hf_dir, capsys):
    (hf_dir / "config.json").write_text('{"mine": true}\n')
    before = cli.snapshot(hf_dir)
    capsys.readouterr()
    rc = main(["export-hf", str(reference), str(hf_dir)])
    line = cli.one_line(capsys.readouterr().err, "export-hf")
    assert rc == 2 and "is not empty (config.json" in line and "--overwrite" in line, line
    assert cli.snapshot(hf_dir) == before
    assert main(["export-hf", str(reference), str(hf_dir), "--overwrite"]) == 0
    assert '"mine"' not in (hf_dir / "config.json").read_text()


def test_export_hf_onto_an_existing_file(cli, reference, tmp_path, capsys):
    target = tmp_path / "model.bin"
    target.write_bytes(b"mine")
    capsys.readouterr()
    rc = main(["export-hf", str(reference), str(target)])
    line = cli.one_line(capsys.readouterr().err, "export-hf")
    assert rc == 2 and "is an existing file, not a directory" in line, line
    assert target.read_bytes() == b"mine"


def test_plot_into_a_read_only_directory(cli, reference, tmp_path, unshare):
    ro = tmp_path / "ro"
    ro.mkdir()
    command = " ".join(f"'{a}'" for a in cli.cmd("plot", reference, "--output", ro / "loss.png"))
    done = subprocess.run([*unshare, f"mount --bind -o ro {ro} {ro} && {command}"], env=cli.env(),
                          capture_output=True, text=True, timeout=120)
    line = cli.one_line(done.stderr, "plot")
    assert done.returncode == 2 and f"cannot write the plot to {ro}/loss.png: Read-only file system" in line
    assert os.listdir(ro) == []


DATA = {  # file name, bytes, what the one line must say
    "not utf-8": ("notes.txt", b"hello\nw\xf6rld\n", "is not UTF-8 text: byte 0xf6 at byte offset 7 (line 2)"),
    "jsonl not utf-8": ("rows.jsonl", b'{"text": "hello"}\n{"text": "w\xf6rld"}\n',
                        "is not UTF-8 text: byte 0xf6 at byte offset 29 (line 2)"),
    "bad json line": ("rows.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": "c"\n', "rows.jsonl, line 3: not valid JSON"),
    "bad csv row": ("rows.csv", b"text,id\nhello,1\nworld,2,3\n", "rows.csv, line 3: 3 fields where the header has 2"),
}


@pytest.mark.parametrize("case", list(DATA))
def test_a_data_error_names_the_file_and_the_place(cli, tmp_path, case, capsys):
    name, content, expected = DATA[case]
    (tmp_path / name).write_bytes(content)
    out = tmp_path / "never"
    argv = cli.args(out, 4)
    argv[argv.index("--data") + 1] = str(tmp_path / name)
    capsys.readouterr()
    rc = main(argv)
    line = cli.one_line(capsys.readouterr().err)
    assert rc == 2 and expected in line and str(tmp_path / name) in line, line
    assert not out.exists()


def test_a_hub_spec_without_network_fails_within_seconds(cli, tmp_path, monkeypatch, capsys):
    """Online mode, with the Hub endpoint at a local port where nothing listens."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    out = tmp_path / "never"
    argv = cli.args(out, 4)
    argv[argv.index("--data") + 1] = "hub:someone/some-dataset"
    capsys.readouterr()
    started = time.monotonic()
    rc = main(argv)
    elapsed = time.monotonic() - started
    line = cli.one_line(capsys.readouterr().err)
    assert rc == 2 and "cannot be reached" in line and "someone/some-dataset" in line, line
    assert elapsed < 10, f"{elapsed:.1f}s"


@pytest.mark.parametrize("seed", ["-1", str(2**70)])
def test_a_seed_outside_32_bits_is_refused_before_anything_is_written(cli, tmp_path, seed, capsys):
    out = tmp_path / "never"
    capsys.readouterr()
    rc = main(cli.args(out, 4, "--seed", seed))
    line = cli.one_line(capsys.readouterr().err)
    assert rc == 2 and f"--seed {seed} must be an integer from 0 to 4294967295" in line, line
    assert not out.exists()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # argparse's own error: one line, status 2
        main(["generate", "--checkpoint", str(out), "--prompt", "x", "--seed", seed])
    assert e.value.code == 2
    assert "is not an integer from 0 to 4294967295" in cli.one_line(capsys.readouterr().err, "generate")


@pytest.mark.parametrize("flags, expected", [
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--mesh", ""], "--mesh '' names no mesh axis"),
    (["--seq-len", "100000"], "--seq-len 100000 exceeds the model's 256 positions"),
    (["--device-memory", "80"], "device memory '80' has no unit: write 80GB"),
])
def test_plan_refuses_a_workload_it_would_misreport(cli, flags, expected, capsys):
    args = {"--mesh": "fsdp=8", **dict(zip(flags[::2], flags[1::2], strict=True))}
    capsys.readouterr()
    rc = main(["plan", "--model", "llama-tiny", "--rules", "fsdp", *[x for kv in args.items() for x in kv]])
    line = cli.one_line(capsys.readouterr().err, "plan")
    assert rc == 2 and expected in line, line


@pytest.mark.parametrize("target, expected", [
    ("loss.txt", "its extension .txt is not an image format"),
    ("plots", "is a directory: give a file such as"),
    ("loss", "it has no extension"),
])
def test_plot_refuses_an_output_it_cannot_write_as_named(cli, reference, tmp_path, target, expected, capsys):
    (tmp_path / "plots").mkdir()
    before = cli.snapshot(tmp_path)
    capsys.readouterr()
    rc = main(["plot", str(reference), "--output", str(tmp_path / target)])
    line = cli.one_line(capsys.readouterr().err, "plot")
    assert rc == 2 and expected in line, line
    assert cli.snapshot(tmp_path) == before  # no loss.txt, no plots.png, no loss.png


@pytest.mark.parametrize("flags, expected", [
    (["--coordinator", "127.0.0.1:12345", "--num-processes", "2", "--process-id", "5"],
     "--process-id 5 must be from 0 to --num-processes - 1 (1)"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "1"],
     "--coordinator 'localhost' must be HOST:PORT"),
    (["--lora-rank", "2", "--lora-alpha", "inf"], "lora_alpha=inf must be a finite number > 0"),
])
def test_bad_multi_host_and_lora_flags_are_refused_before_anything_starts(cli, tmp_path, flags, expected, capsys):
    out = tmp_path / "never"
    capsys.readouterr()
    rc = main(cli.args(out, 4, *flags))
    line = cli.one_line(capsys.readouterr().err)
    assert rc == 2 and expected in line, line
    assert not out.exists()


def test_an_unreachable_coordinator_is_one_line_and_exit_1_within_its_timeout(cli, tmp_path):
    """jax's client aborts the process (SIGABRT) when the coordinator never answers; the
    launcher connects first and gives up after --distributed-timeout with one line."""
    out = tmp_path / "never"
    start = time.monotonic()
    done = cli.run(*cli.args(out, 4, "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "1",
                             "--distributed-timeout", "2"), timeout=120)
    line = cli.one_line(done.stderr)
    assert done.returncode == 1 and "--coordinator 127.0.0.1:1: no answer within --distributed-timeout 2 s" in line
    assert time.monotonic() - start < 60 and not out.exists()


def test_a_binary_rules_file_and_a_mesh_beyond_int32_are_one_line(cli, tmp_path, capsys):
    rules = tmp_path / "rules.yaml"
    rules.write_bytes(b"\xff\xfe\x00 not text")
    for flags, expected in ((["--rules", str(rules), "--mesh", "fsdp=8"],
                             f"rule file {rules} is not UTF-8 text (byte 0xff at offset 0)"),
                            (["--rules", "fsdp", "--mesh", "fsdp=65536,tensor=65536"],
                             "4294967296 devices in all; a mesh holds at most 2147483647")):
        capsys.readouterr()
        rc = main(["plan", "--model", "llama-tiny", *flags])
        line = cli.one_line(capsys.readouterr().err, "plan")
        assert rc == 2 and expected in line, line
