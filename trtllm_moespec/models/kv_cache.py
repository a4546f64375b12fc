"""A static KV cache with one slot per request, preallocated once and written in place.

Layout: one tensor `[layers, 2, slots, kv_heads, max_len, head_dim]` (index 0 = keys,
1 = values), as in gpt-fast's `KVCache` but with a slot axis so that a batch of requests
can share one buffer (a serving loop hands a slot to each request). A forward writes its
new keys at cache index `prefix_len + t` of its slot; attention reads the slot's
`[0, prefix_len + T)` range. Tree slots of a verify forward are simply overwritten by the
next one: `commit` copies the accepted tree slots down behind the committed prefix in one
gather over all layers (a no-op when the accepted nodes already sit there in order), and
rejected slots need no clean-up at all.

Sliding-window layers keep their full history here, exactly like full-attention layers:
the window is applied by the attention mask and by reading only the last `window - 1`
committed keys (see `lean_attention.py`). A ring buffer of `window` entries would save
memory, but the accepted tree slots of a step are gathered by cache index, and a ring would
wrap over keys the window still needs while a tree is pending; full history keeps commit
a plain gather.

Capacity grows on demand (doubling `max_len`, or the slot count) by one copy; a CUDA-graph
runner must recapture after growth, which is why callers preallocate what they need.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch


class StaticKVCache:
    """Preallocated K/V for `num_layers` attention layers and a pool of request slots."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, num_slots: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", max_len_cap: int | None = None):
        if min(num_layers, num_kv_heads, head_dim, max_len, num_slots) < 1:
            raise ValueError("StaticKVCache sizes must all be >= 1")
        self.max_len_cap = max_len_cap  # the model's position limit: growth never goes past it
        self.kv = torch.zeros(num_layers, 2, num_slots, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self._free: list[int] = list(range(num_slots))[::-1]

    # ------------------------------------------------------------------ sizes
    @property
    def num_slots(self) -> int:
        return self.kv.shape[2]

    @property
    def max_len(self) -> int:
        return self.kv.shape[4]

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    # ------------------------------------------------------------------ slots
    def acquire(self, owner: object | None = None) -> int:
        """The lowest free slot id (the pool grows when all are taken). With `owner`, the slot is
        released automatically when `owner` is garbage-collected.

        Lowest first keeps the slots in use a consecutive block 0..B-1 whenever a freed slot is
        taken again, whatever order requests finish in: a batched forward then reads its K/V as
        one view of that block instead of gathering (copying) every request's cache each step
        (`lean_forward._HostIndexedIO`; the batch is ordered by slot, `engine.batch.verify_batch`)."""
        if not self._free:
            self._grow(slots=2 * self.num_slots)
        slot = min(self._free)
        self._free.remove(slot)
        if owner is not None:
            weakref.finalize(owner, self._release_ref(), slot)
        return slot

    def _release_ref(self):
        ref = weakref.ref(self)

        def release(slot: int) -> None:
            cache = ref()
            if cache is not None and slot not in cache._free:
                cache._free.append(slot)
        return release

    def release(self, slot: int) -> None:
        if slot not in self._free:
            self._free.append(slot)

    def ensure_len(self, length: int) -> None:
        """Make room for `length` cache positions per slot (doubling, capped by max_len_cap)."""
        if length <= self.max_len:
            return
        if self.max_len_cap is not None and length > self.max_len_cap:
            raise ValueError(f"sequence of {length} tokens exceeds the model's maximum of {self.max_len_cap} positions")
        new_len = max(length, 2 * self.max_len)
        if self.max_len_cap is not None:
            new_len = min(new_len, self.max_len_cap)
        self._grow(max_len=new_len)

    def _grow(self, slots: int | None = None, max_len: int | None = None) -> None:
        L, two, S, H, M, D = self.kv.shape
        slots, max_len = slots or S, max_len or M
        kv = self.kv.new_zeros(L, two, slots, H, max_len, D)
        kv[:, :, :S, :, :M] = self.kv
        self.kv = kv
        self._free = list(range(slots - 1, S - 1, -1)) + self._free

    # ------------------------------------------------------------------ access
    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer i, each [slots, kv_heads, max_len, head_dim] (views)."""
        return self.kv[i, 0], self.kv[i, 1]

    def commit(self, slot: int, prefix_len: int, keep: torch.Tensor) -> None:
        """Move the kept tree slots `keep` [n] (cache indices, increasing) to
        `prefix_len .. prefix_len + n - 1` of `slot`, in every layer at once."""
        n = keep.numel()
        if n == 0:
            return
        if self.kv.device.type == "cpu" and self.kv.dtype in (torch.float32, torch.float16):
            # numpy on the same storage: about half the time of torch's advanced-indexing copy (issue 25)
            k, rows = keep.numpy(), self.kv.numpy()[:, :, slot]  # rows [L, 2, H, max_len, D]
            if k[0] != prefix_len or (n > 1 and (np.diff(k) != 1).any()):
                rows[:, :, :, prefix_len:prefix_len + n] = rows[:, :, :, k]  # the gather copies first
            return
        dst = torch.arange(prefix_len, prefix_len + n, device=keep.device)
        if torch.equal(keep, dst):
            return  # the accepted path is already in place (a chain, or plain decoding)
        # The right-hand side is gathered into a new tensor first, so overlapping ranges are safe.
        self.kv[:, :, slot, :, prefix_len:prefix_len + n] = self.kv[:, :, slot, :, keep]
