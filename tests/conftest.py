"""Suite-wide settings: one intra-op thread per test process; moespec-tiny where no model is named;
the full-disk fault of the report-writing tests.

The suite runs under pytest-xdist with one worker per core; more threads per
worker oversubscribe the cores and OpenMP barriers then stall for whole
scheduler time slices.
"""

import errno
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
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
