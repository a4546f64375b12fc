"""The EAGLE-3 drafter's per-request K/V cache (`Eagle3Cache`) and the pool that reuses its buffers
across requests (`DrafterKVPool`), so that CUDA graphs captured over a buffer keep replaying."""

from __future__ import annotations

import collections
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .workspace import DraftWorkspace


class DrafterKVPool:
    """Drafter K/V buffers [2, 1, KVH, capacity, D] reused across requests.

    A request's buffer comes back here when its `Eagle3Cache` is garbage-collected (as the target's
    cache slots do) or when the cache outgrows it, and the next request takes it instead of
    allocating its own. Why: a CUDA graph of a drafter forward is bound to the buffer it was
    captured over (`graphs.DrafterGraphStore` keeps graphs per buffer, as long as the buffer
    lives), so requests that reuse buffers replay graphs instead of capturing new ones; with one
    request at a time every request runs on the same buffer. The pool keeps as many free buffers
    as were ever in use at once (the engine's concurrency so far), so memory stays what the busiest
    moment needed.
    """

    def __init__(self):
        self._free: list[torch.Tensor] = []  # largest first
        # Buffers given back and not yet sorted into _free. `give` runs in a cache's finalizer, which the garbage
        # collector may call inside `take` (any allocation can start a collection) or on another thread, so it
        # must never wait for the lock (a finalizer firing inside `take` would wait for itself): it leaves the
        # buffer here (a deque's append is atomic) and sorts it in only when the lock is free.
        self._returned: collections.deque[torch.Tensor] = collections.deque()
        self._lock = threading.Lock()
        self.allocated = 0  # buffers allocated so far (a reused buffer does not count)
        self._out = 0  # buffers taken and not yet sorted back in
        self.peak = 0  # the most buffers in use at once

    @property
    def in_use(self) -> int:
        """Buffers taken and not given back."""
        return self._out - len(self._returned)

    def take(self, length: int, like: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """A buffer of at least `length` positions with K/V shape `like` = (KVH, D): the smallest free
        one that fits, zeroed (a reused buffer's stale keys are masked out, but zeros keep even a
        masked product finite), else a new one of max(length, 256) positions."""
        device = torch.device(device)
        with self._lock:
            self._sort_in_returned()
            fits = [kv for kv in self._free if kv.shape[3] >= length and (kv.shape[2], kv.shape[4]) == like
                    and kv.dtype == dtype and kv.device == device]
            kv = min(fits, key=lambda t: t.shape[3]) if fits else None
            if kv is not None:
                self._free = [t for t in self._free if t is not kv]
            else:
                self.allocated += 1
            self._out += 1
            self.peak = max(self.peak, self._out)
        return kv.zero_() if kv is not None else _new_buffer(length, like, dtype, device)

    def give(self, kv: torch.Tensor) -> None:
        """Return a buffer no cache uses any more. Never blocks: safe in a finalizer."""
        self._returned.append(kv)
        if self._lock.acquire(blocking=False):  # else the holder, or the next take, sorts it in
            try:
                self._sort_in_returned()
            finally:
                self._lock.release()

    def _sort_in_returned(self) -> None:
        """Move the given-back buffers into the free list (the lock held); beyond the busiest moment's
        count, the smallest go."""
        if not self._returned:
            return
        while self._returned:
            self._free.append(self._returned.popleft())
            self._out -= 1
        self._free.sort(key=lambda t: t.shape[3], reverse=True)
        del self._free[self.peak:]


def _new_buffer(length: int, like: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed K/V buffer [2, 1, KVH, capacity, D] of max(length, 256) positions, like = (KVH, D)."""
    return torch.zeros(2, 1, like[0], max(length, 256), like[1], dtype=dtype, device=device)


class _Lease:
    """The buffer a cache holds, shared with the finalizer that returns it to the pool."""

    def __init__(self):
        self.kv: torch.Tensor | None = None

    def give_back(self, pool: DrafterKVPool) -> None:
        if self.kv is not None:
            pool.give(self.kv)
            self.kv = None


@dataclass
class Eagle3Cache:
    """Per-request drafter state (mutable; owned by the engine): KV of committed positions
    plus the last position's outputs, which propose the root's children.

    K/V live in one preallocated buffer written in place (no concatenation per step);
    positions past `num_tokens` are scratch space that tree drafting writes its keys to.
    With a `pool` the buffer is taken from it and returned to it (see `DrafterKVPool`).
    """

    kv: torch.Tensor | None = None  # [2, 1, KVH, capacity, D] keys (0) and values (1)
    num_tokens: int = 0  # committed drafter positions S
    last_logits: torch.Tensor | None = None  # [1, V_draft] float32 at position S-1
    last_hidden: torch.Tensor | None = None  # [1, H] pre-norm output at position S-1
    pool: DrafterKVPool | None = None
    _lease: _Lease | None = None
    # the CPU drafting buffers this request's steps draft their trees in (workspace.py; None until the first)
    workspace: "DraftWorkspace | None" = field(default=None, repr=False, compare=False)

    @property
    def keys(self) -> torch.Tensor | None:
        """[1, KVH, S, D] view of the committed keys."""
        return None if self.kv is None else self.kv[0, :, :, :self.num_tokens]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.kv is None else self.kv[1, :, :, :self.num_tokens]

    def reserve(self, length: int, num_kv_heads: int, head_dim: int, dtype, device) -> torch.Tensor:
        """The buffer, grown (doubling, contents kept) to hold `length` positions."""
        if self.kv is None or self.kv.shape[3] < length:
            capacity = length if self.kv is None else max(length, 2 * self.kv.shape[3])
            take = _new_buffer if self.pool is None else self.pool.take
            kv = take(capacity, (num_kv_heads, head_dim), dtype, device)
            if self.kv is not None:
                kv[:, :, :, :self.num_tokens] = self.kv[:, :, :, :self.num_tokens]
            self._hold(kv)
        return self.kv

    def _hold(self, kv: torch.Tensor) -> None:
        if self.pool is not None:
            if self._lease is None:
                self._lease = _Lease()
                weakref.finalize(self, self._lease.give_back, self.pool)
            self._lease.give_back(self.pool)  # the outgrown buffer, if any
            self._lease.kv = kv
        self.kv = kv

