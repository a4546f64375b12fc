"""numba for the CPU step's host work: the compiled drafting step (models/eagle3/fused_step.py), node
values (values_host.py) and EVICT's selection (select_host.py). Each is optional: without numba, or with
its switch set to 0, the numpy/torch path it was written against runs instead."""

from __future__ import annotations

import os


def switched_on(variable: str) -> bool:
    """False when the environment turns this compiled path off (`variable=0`)."""
    return os.environ.get(variable, "1") != "0"


def numba_jit():
    """`numba.njit` as these kernels use it (cached beside the module, no GIL), or None without numba."""
    try:
        import numba
    except ImportError:
        return None
    return numba.njit(cache=True, nogil=True)
