"""Suite-wide settings: one intra-op thread per test process; moespec-tiny where no model is named.

The suite runs under pytest-xdist with one worker per core; more threads per
worker oversubscribe the cores and OpenMP barriers then stall for whole
scheduler time slices.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite's default model is the fast moespec-tiny (also in subprocesses, which inherit this);
# tests that need moespec-base name it.
os.environ["MOESPEC_DEFAULT_MODEL"] = "moespec-tiny"

import torch  # noqa: E402

torch.set_num_threads(1)
