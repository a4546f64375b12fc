"""Suite-wide settings: one intra-op thread per test process.

The suite runs under pytest-xdist with one worker per core; more threads per
worker oversubscribe the cores and OpenMP barriers then stall for whole
scheduler time slices.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
