"""Suite-wide settings: one intra-op thread per test process; moespec-tiny where no model is named;
numba's bounds checks; a watchdog for hangs Python cannot interrupt; the full-disk fault of the
report-writing tests.

The suite runs under pytest-xdist with one worker per core; more threads per
worker oversubscribe the cores and OpenMP barriers then stall for whole
scheduler time slices.
"""

import errno
import faulthandler
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The compiled host kernels (core/host_jit.py) check their indices; numba's cache does not tell checked code
# from unchecked, so the suite compiles into a cache of its own (never an older or NUMBA_BOUNDSCHECK=0 build
# left beside the package) and checks every index even where a kernel's flags say otherwise, in this process
# and the ones it starts. An unchecked write past an array once corrupted the heap and hung a CI run.
os.environ.setdefault("NUMBA_BOUNDSCHECK", "1")
os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"moespec-numba-checked-{os.getuid()}"))
# The suite's default model is the fast moespec-tiny (also in subprocesses, which inherit this);
# tests that need moespec-base name it.
os.environ["MOESPEC_DEFAULT_MODEL"] = "moespec-tiny"

import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def disk_full_in(monkeypatch):
    """disk_full_in(directory): from now on, reports written into `directory` fail as on a full disk
    (ENOSPC from `outfiles.write_text_atomic`); writes elsewhere (the fallback) go through."""
    import trtllm_moespec.outfiles as outfiles

    def fill(directory: Path) -> None:
        real = outfiles.write_text_atomic

        def write(path, text):
            if Path(path).parent == directory:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(path, text)

        monkeypatch.setattr(outfiles, "write_text_atomic", write)

    return fill


# ------------------------------------------------------------------ the watchdog
# pytest-timeout (pyproject: timeout) fails a test stuck in Python; a thread stuck in C with the GIL held (a
# deadlock in a native library, a corrupted heap) never returns to Python and would hold the whole run until
# CI's limit. Past WATCHDOG_S faulthandler, from a C thread, writes every thread's stack to a log and ends the
# test process; under xdist the controller reports the crashed test and prints the log.
WATCHDOG_S = 420
_OWN_WATCHDOG_DIR = "MOESPEC_WATCHDOG_DIR" not in os.environ  # this process makes it (xdist's workers inherit it)
if _OWN_WATCHDOG_DIR:
    os.environ["MOESPEC_WATCHDOG_DIR"] = tempfile.mkdtemp(prefix="moespec-watchdog-")
_WATCHDOG_DIR = Path(os.environ["MOESPEC_WATCHDOG_DIR"])
_watchdog_log = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _watchdog_log
    if _watchdog_log is None:
        _watchdog_log = open(_WATCHDOG_DIR / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.log", "w")
    _watchdog_log.write(f"{item.nodeid}\n")
    _watchdog_log.flush()
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True, file=_watchdog_log)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_report_header(config):
    return f"watchdog: a test stuck past {WATCHDOG_S} s ends its process, every thread's stack in {_WATCHDOG_DIR}"


@pytest.hookimpl(optionalhook=True)  # an xdist hook: runs without xdist (tests.mutants) must not miss it
def pytest_testnodedown(node, error):
    """(xdist, controller) A worker that died: print what its watchdog logged."""
    if not error:
        return
    for log in sorted(_WATCHDOG_DIR.glob(f"{node.gateway.id}-*.log")):
        text = log.read_text(errors="replace")
        if "Thread 0x" in text or "Current thread" in text:
            sys.stderr.write(f"\n---- watchdog log of {node.gateway.id} ({log}) ----\n{text}\n")


def pytest_unconfigure(config):
    if _watchdog_log is not None:  # every test has ended: nothing is left for the watchdog to write
        _watchdog_log.close()
    if _OWN_WATCHDOG_DIR:
        shutil.rmtree(_WATCHDOG_DIR, ignore_errors=True)
