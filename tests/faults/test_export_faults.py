"""``export-hf`` onto a disk that fills up: one line, exit 1, nothing left in OUT_DIR, the run
as it was (safetensors reports the write's I/O error as its own exception type)."""

import subprocess


def test_export_hf_onto_a_full_disk_exits_1_and_leaves_nothing(cli, reference, tmp_path, unshare):
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "export"
    run = cli.snapshot(reference)
    command = " ".join(f"'{a}'" for a in cli.cmd("export-hf", reference, out))
    # 20 KiB: room for the directory and its lock, not for the ~100 KiB of weights
    script = (f"mount -t tmpfs -o size=20k tmpfs {disk} && {command}; status=$?; "
              f"ls -A {disk} > {tmp_path / 'left'}; ls -A {out} >> {tmp_path / 'left'} 2>/dev/null; exit $status")
    done = subprocess.run([*unshare, script], env=cli.env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    line = cli.one_line(done.stderr, "export-hf")
    assert str(out) in line and "No space left on device" in line and "nothing was left there" in line, line
    assert (tmp_path / "left").read_text().split() == []  # OUT_DIR (created by the command) is gone
    assert cli.snapshot(reference) == run
