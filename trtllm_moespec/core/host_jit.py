"""numba for the CPU step's host work: the compiled drafting step (models/eagle3/fused_step.py), node
values (values_host.py, followers_host.py), selection (select_host.py) and layout (layout_host.py). Each
is optional: without numba, or with its switch set to 0, the numpy/torch path it was written against runs
instead."""

from __future__ import annotations

import os
import threading


def switched_on(variable: str) -> bool:
    """False when the environment turns this compiled path off (`variable=0`)."""
    return os.environ.get(variable, "1") != "0"


def numba_jit(boundscheck: bool = True, fastmath: bool | set[str] = False):
    """`numba.njit` as these kernels use it (cached beside the module, no GIL, bounds-checked), or None
    without numba. `fastmath`: LLVM's float flags for a kernel whose sums may be reordered (vectorised).

    Bounds checks: an index past an array raises IndexError instead of reading or writing outside it. An
    unchecked write once corrupted the heap (`select_host.top_nodes` given an empty order by a cost table of
    C(0) alone) and hung a test run; checked, the kernels cost ~0.04 ms more per speculative step on
    moespec-base (of ~30 ms; benchmarks/bench_step_overhead.py with NUMBA_BOUNDSCHECK=0 and 1 alternated)."""
    try:
        import numba
    except ImportError:
        return None
    return numba.njit(cache=True, nogil=True, boundscheck=boundscheck, fastmath=fastmath)


_compiled: dict[tuple[str, tuple[str, ...]], tuple | None] = {}
_compiling = threading.Lock()


def compiled_kernels(switch: str, namespace: dict, kernels: tuple[str, ...], helpers: tuple[str, ...] = (),
                     boundscheck: bool = True, fastmath: bool | set[str] = False) -> tuple | None:
    """A module's `kernels` compiled (namespace: its `globals()`), once per module, or None when numba is
    missing or `switch` is 0. numba compiles the helpers a kernel calls by their global names, so those
    names are first rebound to their compiled versions (still plain callables from Python); a kernel that
    is also a helper comes back as that compiled helper. `boundscheck=False` only for a kernel that checks
    every index it reads itself (models/acceptance_head_host.py); `fastmath` as `numba_jit`, for the kernel and
its helpers."""
    if not switched_on(switch):
        return None
    key = (namespace["__name__"], kernels)
    if key in _compiled:  # every step asks: no lock once compiled
        return _compiled[key]
    with _compiling:
        if key not in _compiled:
            jit = numba_jit(boundscheck, fastmath)
            if jit is not None:
                for name in helpers:  # a helper imported from a module that compiled it already stays as it is
                    fn = namespace[name]
                    namespace[name] = fn if hasattr(fn, "py_func") else jit(fn)
            _compiled[key] = None if jit is None else tuple(
                namespace[name] if name in helpers else jit(namespace[name]) for name in kernels)
    return _compiled[key]
