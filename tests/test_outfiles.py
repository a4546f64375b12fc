"""Output files of the long commands (trtllm_moespec/outfiles.py): checked before the run, written
atomically with the usual permissions, never lost when the final write fails; `moespec replay`'s
outputs through them."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

import trtllm_moespec.outfiles as outfiles
from trtllm_moespec.cli import main as cli_main
from trtllm_moespec.outfiles import atomic_path, check_writable, save_report, write_text_atomic


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield 0o027
    os.umask(old)


def test_check_writable_names_the_flag_and_the_reason(tmp_path):
    (tmp_path / "f").write_text("x")
    check_writable(tmp_path / "new" / "deeper" / "r.json", "--json")  # missing folders are made at write time
    check_writable(tmp_path / "plots", "--plots", want_dir=True)
    check_writable(tmp_path, "--plots", want_dir=True)
    for path, want_dir, message in ((tmp_path, False, "--json .* is a directory"),
                                    (tmp_path / "f", True, "--json .* is a file"),
                                    (tmp_path / "f" / "r.json", False, "is not a directory"),
                                    (Path("/sys/moespec/r.json"), False, "cannot create files in /sys")):
        with pytest.raises(ValueError, match=message):
            check_writable(path, "--json", want_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # the probe leaves nothing behind


def test_files_get_the_mode_open_gives(tmp_path, umask_027):
    """tempfile and safetensors create 0600 files; ours get 0o666 & ~umask, or an existing file's mode."""
    new = write_text_atomic(tmp_path / "a" / "r.json", "{}\n")
    assert new.read_text() == "{}\n" and stat.S_IMODE(new.stat().st_mode) == 0o640
    os.chmod(new, 0o604)
    write_text_atomic(new, "[]\n")
    assert new.read_text() == "[]\n" and stat.S_IMODE(new.stat().st_mode) == 0o604
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "b.bin") as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no stray temporary, no half file


def test_save_report_falls_back_to_the_temporary_folder_then_stdout(tmp_path, monkeypatch, capsys):
    real = outfiles.write_text_atomic
    monkeypatch.setattr(outfiles, "write_text_atomic", lambda p, t: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")) if Path(p).parent == tmp_path else real(p, t))
    went = save_report(tmp_path / "r.json", "{\"ok\": 1}\n", "--json", "moespec x")
    assert went is not None and went.parent != tmp_path and went.read_text() == "{\"ok\": 1}\n"
    assert f"moespec x: error: cannot write --json {tmp_path / 'r.json'} (No space left on device); the report " \
           f"went to {went}" in capsys.readouterr().err
    went.unlink()
    monkeypatch.setattr(outfiles, "write_text_atomic", lambda p, t: (_ for _ in ()).throw(OSError(errno.EROFS, "ro")))
    assert save_report(tmp_path / "r.json", "{\"ok\": 2}", "--json", "moespec x") is None
    captured = capsys.readouterr()
    assert "the report follows on stdout" in captured.err and captured.out == "{\"ok\": 2}\n"


def test_replay_outputs_are_checked_first_and_get_the_usual_mode(tmp_path, umask_027, capsys):
    """(case replay-out-unwritable) `replay record --out` in a folder that cannot take files fails before
    anything is recorded; (case report-umask) the record (safetensors: 0600 by itself) gets 0o666 & ~umask."""
    assert cli_main(["replay", "record", "--out", "/sys/moespec/r.safetensors"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--out /sys/moespec/r.safetensors: cannot create files in /sys" in err
    out = tmp_path / "r.safetensors"
    assert cli_main(["replay", "record", "--model", "moespec-tiny", "--datasets", "gsm8k", "--num-prompts", "1",
                     "--max-tokens", "3", "--no-hidden", "--out", str(out)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.safetensors"]
    report = tmp_path / "rank.json"
    assert cli_main(["replay", "rank", str(out), "--values", "raw", "--k", "1,2", "--json", str(report)]) == 0
    assert stat.S_IMODE(report.stat().st_mode) == 0o640
