"""bench_easydel.py's plumbing without EasyDeL: the result-line parser and the subprocess call,
driven by a stand-in interpreter (a shell script) in place of an EasyDeL environment's python."""

import json
import os
import stat

import pytest

from shardzoo.bench.bench_easydel import RESULT_KEYS, parse_result, run

RESULT = {"wall_s": 1.5, "cpu_s": 2.5, "losses": [9.1, 9.0], "easydel": "0.3.0", "jax": "0.9.2"}


def _fake_python(tmp_path, body: str) -> str:
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_parse_result_takes_the_last_result_line_among_other_output():
    older = {**RESULT, "cpu_s": 9.9}
    stdout = "\n".join(["log line", json.dumps(older), "{not json", json.dumps({"wall_s": 1.0}),
                        "  " + json.dumps(RESULT) + "  ", "trailing log"])
    assert parse_result(stdout) == RESULT


@pytest.mark.parametrize("stdout", ["", "no json here\n", json.dumps({"wall_s": 1.0, "cpu_s": 2.0}), "[1, 2]"])
def test_parse_result_without_a_result_line_names_the_keys(stdout):
    with pytest.raises(ValueError, match="no result line.*" + ", ".join(RESULT_KEYS)):
        parse_result(stdout)


def test_run_passes_steps_and_parses_the_stand_in_output(tmp_path, monkeypatch):
    out = tmp_path / "argv"
    python = _fake_python(tmp_path, f'echo "$@" "[$PYTHONPATH]" > {out}\necho "log line"\n'
                                    f"echo '{json.dumps(RESULT)}'\n")
    monkeypatch.setenv("PYTHONPATH", "/somewhere/shardzoo_pkg")
    assert run(python, warmup=1, steps=4) == RESULT
    script, *flags, pythonpath = out.read_text().split()
    assert script.endswith(os.path.join("bench", "bench_easydel.py"))
    assert flags == ["--warmup", "1", "--steps", "4"]
    assert pythonpath == "[]"  # EasyDeL's environment does not see shardzoo's path


def test_run_reports_a_failing_interpreter_with_its_stderr(tmp_path):
    python = _fake_python(tmp_path, "echo 'ModuleNotFoundError: easydel' >&2\nexit 3\n")
    with pytest.raises(RuntimeError, match="exited 3(.|\n)*ModuleNotFoundError: easydel"):
        run(python)
