"""Output files of the long commands (`moespec bench`, `profile`, `replay`): checked before the
measurement, written atomically with the usual permissions, and never lost.

- `check_writable`: before a run that takes minutes, the path a report goes to is checked (a
  directory where a file goes or the reverse, a parent that is a file, a folder this process cannot
  create files in), so the run does not end by losing its result.
- `atomic_path` / `write_text_atomic`: write through a temporary file in the same directory and a
  rename, so readers see the old file or the new one, never half of one. The file gets the mode a
  plain `open(path, "w")` gives (an existing file's mode, else 0o666 less the umask): `tempfile`
  and safetensors create 0600 files, which other users of a shared results folder could not read.
- `save_report`: when the final write fails anyway (the disk filled up during the run), the report
  goes to the temporary directory instead, or to stdout as a last resort, and stderr says where.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_path", "check_writable", "save_report", "write_text_atomic"]


def check_writable(path: str | Path, flag: str, want_dir: bool = False) -> None:
    """ValueError (naming `flag`) unless a file (or, `want_dir`, a directory) can be created at `path`."""
    path = Path(path)
    if path.exists() and path.is_dir() != want_dir:
        raise ValueError(f"{flag} {path} is {'a file' if want_dir else 'a directory'}; give a "
                         f"{'directory' if want_dir else 'file path'}")
    base = path if want_dir and path.is_dir() else next((p for p in path.parents if p.exists()), Path("."))
    if not base.is_dir():
        raise ValueError(f"{flag} {path}: {base} is not a directory")
    try:  # the one reliable test of "can create files here" (os.access ignores read-only mounts and ACLs)
        fd, probe = tempfile.mkstemp(dir=base, prefix=".moespec-write-test.")
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create files in {base} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` to write to; on success it becomes `path` (module docstring),
    on any failure it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, _plain_mode(path))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically, with a plain file's mode (module docstring)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def save_report(path: str | Path, text: str, flag: str, prog: str) -> Path | None:
    """Write a report to `path`; if that fails, to the temporary directory, else to stdout. Returns
    where it went (None: stdout); every fallback is said on stderr, naming `flag` and the error."""
    path = Path(path)
    try:
        return write_text_atomic(path, text)
    except OSError as e:
        why = e.strerror or str(e)
    fallback = Path(tempfile.gettempdir()) / f"{path.stem}.{os.getpid()}{path.suffix}"
    try:
        write_text_atomic(fallback, text)
    except OSError:
        print(f"{prog}: error: cannot write {flag} {path} ({why}), nor {fallback}; the report follows on stdout",
              file=sys.stderr)
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
        return None
    print(f"{prog}: error: cannot write {flag} {path} ({why}); the report went to {fallback}", file=sys.stderr)
    return fallback


def _plain_mode(path: Path) -> int:
    """The mode `open(path, "w")` leaves: an existing file keeps its own, a new one gets 0o666 & ~umask."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read without changing it where Linux allows (os.umask sets it to read it,
    which another thread creating a file at that moment would see)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
