"""Rank 0 drives, every rank runs the target forward.

Rank 0 runs the whole engine (draft -> select -> verify -> commit) on a
`LeaderTarget`: each target call (new cache, prefill, verify, commit, discard)
first broadcasts a small command over the control group, then runs locally. The
other ranks sit in `serve_target`, replaying those commands on their own
expert-sharded replica with their own KV caches; the MoE all-reduces inside the
forwards keep the ranks in step. Only rank 0 reads logits, samples and accepts,
so sampling with a seed gives the same tokens as one process.

Commands are int64 tensors (a fixed header and one payload): nothing is pickled.
"""

from __future__ import annotations

import weakref
from dataclasses import fields

import torch

from ..core.layout import TreeLayout
from ..models.target import TargetCache, TargetModel, TargetOutput
from .dist import EPGroup, maybe_inject_fault

NEW, PREFILL, VERIFY, COMMIT, DISCARD, FREE, STOP = range(1, 8)
_HEADER = 6  # [op, cache id, payload length, arg a, arg b, command count]


class Channel:
    """Rank 0 -> all ranks command broadcast over the control group (blocking, no spinning)."""

    def __init__(self, group: EPGroup):
        self.group = group
        self.count = 0  # commands sent / received so far

    def send(self, op: int, cache_id: int = -1, payload: torch.Tensor | None = None, a: int = 0, b: int = 0) -> None:
        import torch.distributed as dist

        payload = torch.zeros(0, dtype=torch.int64) if payload is None else payload.reshape(-1).to("cpu", torch.int64)
        self.count += 1
        maybe_inject_fault(self.group.rank, self.count)
        header = torch.tensor([op, cache_id, payload.numel(), a, b, self.count], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group.control)
        if payload.numel():
            dist.broadcast(payload.contiguous(), src=0, group=self.group.control)

    def send_stop(self) -> None:
        """Tell the workers to return from serve_target."""
        self.send(STOP)

    def recv(self) -> tuple[int, int, int, int, torch.Tensor]:
        """(op, cache id, a, b, payload) of rank 0's next command."""
        import torch.distributed as dist

        header = torch.zeros(_HEADER, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group.control)
        op, cache_id, n, a, b, count = header.tolist()
        payload = torch.zeros(n, dtype=torch.int64)
        if n:
            dist.broadcast(payload, src=0, group=self.group.control)
        self.count = count
        maybe_inject_fault(self.group.rank, count)
        return op, cache_id, a, b, payload


def pack_layout(layout: TreeLayout) -> tuple[torch.Tensor, int, int]:
    """(flat int64 payload, K, D) of a batch-1 layout."""
    parts = [getattr(layout, f.name).reshape(-1).to("cpu", torch.int64) for f in fields(TreeLayout)]
    return torch.cat(parts), layout.num_positions - 1, layout.max_depth


def unpack_layout(payload: torch.Tensor, K: int, D: int, device: torch.device) -> TreeLayout:
    shapes = {"node_idx": (1, K), "token_ids": (1, 1 + K), "depth": (1, 1 + K), "parent_pos": (1, 1 + K),
              "valid": (1, 1 + K), "paths": (1, 1 + K, D + 1), "num_nodes": (1,)}
    values, start = {}, 0
    for f in fields(TreeLayout):
        shape = shapes[f.name]
        n = int(torch.tensor(shape).prod())
        t = payload[start : start + n].reshape(shape).to(device)
        values[f.name] = t.bool() if f.name == "valid" else t
        start += n
    return TreeLayout(**values)


class LeaderTarget:
    """Rank 0's view of an expert-parallel target: every forward runs on all ranks.

    Behaves as the wrapped `TargetModel` (attributes are forwarded), so the engine,
    drafters and predictors use it unchanged.
    """

    def __init__(self, target: TargetModel, channel: Channel):
        self._target = target
        self._channel = channel
        self._ids: dict[int, int] = {}  # id(cache) -> cache id shared with the workers
        self._next_id = 0
        self._freed: list[int] = []  # ids of collected caches, released on the next command

    def __getattr__(self, name):
        return getattr(self._target, name)

    @property
    def inner(self) -> TargetModel:
        return self._target

    def new_cache(self) -> TargetCache:
        cache = self._target.new_cache()
        cache_id, self._next_id = self._next_id, self._next_id + 1
        self._ids[id(cache)] = cache_id
        weakref.finalize(cache, self._collected, id(cache), cache_id)
        self._send(NEW, cache_id)
        return cache

    def _collected(self, key: int, cache_id: int) -> None:  # GC time: no communication here
        self._ids.pop(key, None)
        self._freed.append(cache_id)

    def prefill(self, cache: TargetCache, input_ids: torch.Tensor, all_logits: bool = False) -> TargetOutput:
        self._send(PREFILL, self._ids[id(cache)], input_ids, a=int(all_logits))
        return self._target.prefill(cache, input_ids, all_logits)

    def verify(self, cache: TargetCache, layout: TreeLayout) -> TargetOutput:
        if layout.batch_size != 1:  # checked before any rank starts a forward
            raise ValueError(f"TargetModel.verify handles one request at a time, got a layout of batch {layout.batch_size}")
        payload, K, D = pack_layout(layout)
        self._send(VERIFY, self._ids[id(cache)], payload, a=K, b=D)
        return self._target.verify(cache, layout)

    def commit(self, cache: TargetCache, accepted_pos: torch.Tensor) -> None:
        self._send(COMMIT, self._ids[id(cache)], accepted_pos)
        self._target.commit(cache, accepted_pos)

    def discard(self, cache: TargetCache) -> None:
        self._send(DISCARD, self._ids[id(cache)])
        self._target.discard(cache)

    def _send(self, op: int, cache_id: int = -1, payload: torch.Tensor | None = None, a: int = 0, b: int = 0) -> None:
        while self._freed:
            self._channel.send(FREE, self._freed.pop())
        self._channel.send(op, cache_id, payload, a, b)


def serve_target(target: TargetModel, channel: Channel) -> int:
    """A worker rank: replay rank 0's target commands until STOP; returns commands served.

    A ValueError from a command is the same check failing on rank 0 with the same
    inputs (raised before any collective): rank 0 reports it, the worker carries on.
    """
    caches: dict[int, TargetCache] = {}
    served = 0
    while True:
        op, cache_id, a, b, payload = channel.recv()
        served += 1
        if op == STOP:
            return served
        try:
            _serve_one(target, caches, op, cache_id, a, b, payload)
        except ValueError:
            continue


def _serve_one(target: TargetModel, caches: dict[int, TargetCache], op: int, cache_id: int, a: int, b: int,
               payload: torch.Tensor) -> None:
    if op == NEW:
        caches[cache_id] = target.new_cache()
    elif op == FREE:
        caches.pop(cache_id, None)
    elif op == PREFILL:
        target.prefill(caches[cache_id], payload.reshape(1, -1).to(target.device), bool(a))
    elif op == VERIFY:
        target.verify(caches[cache_id], unpack_layout(payload, a, b, target.device))
    elif op == COMMIT:
        target.commit(caches[cache_id], payload.to(target.device))
    elif op == DISCARD:
        target.discard(caches[cache_id])
    else:
        raise RuntimeError(f"unknown command {op} from rank 0")
