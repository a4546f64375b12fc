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
from dataclasses import dataclass, fields
from typing import Callable

import torch

from ..core.layout import TreeLayout
from ..models.target import TargetCache, TargetModel, TargetOutput
from .dist import EPGroup, maybe_inject_fault

LOAD, NEW, PREFILL, VERIFY, COMMIT, DISCARD, FREE, STOP = range(1, 9)
_HEADER = 7  # [op, target id, cache id, payload length, arg a, arg b, command count]


@dataclass(frozen=True)
class Command:
    """One command from rank 0, as a worker receives it."""

    op: int
    target_id: int  # which loaded target (several LLMs may share one job)
    cache_id: int  # which KV cache (ids are unique over the job)
    a: int  # op-specific small arguments (see LeaderTarget)
    b: int
    payload: torch.Tensor  # [n] int64


class Channel:
    """Rank 0 -> all ranks command broadcast over the control group (blocking, no spinning)."""

    def __init__(self, group: EPGroup):
        self.group = group
        self.count = 0  # commands sent / received so far
        self._next_id = 0  # target and cache ids, unique over the job

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def send(self, op: int, target_id: int = 0, cache_id: int = 0, payload: torch.Tensor | None = None,
             a: int = 0, b: int = 0) -> None:
        import torch.distributed as dist

        payload = torch.zeros(0, dtype=torch.int64) if payload is None else payload.reshape(-1).to("cpu", torch.int64)
        self.count += 1
        maybe_inject_fault(self.group.rank, self.count)
        header = torch.tensor([op, target_id, cache_id, payload.numel(), a, b, self.count], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group.control)
        if payload.numel():
            dist.broadcast(payload.contiguous(), src=0, group=self.group.control)

    def send_stop(self) -> None:
        """Tell the workers to return from serve_target."""
        self.send(STOP)

    def recv(self) -> Command:
        """Rank 0's next command."""
        import torch.distributed as dist

        header = torch.zeros(_HEADER, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group.control)
        op, target_id, cache_id, n, a, b, count = header.tolist()
        payload = torch.zeros(n, dtype=torch.int64)
        if n:
            dist.broadcast(payload, src=0, group=self.group.control)
        self.count = count
        maybe_inject_fault(self.group.rank, count)
        return Command(op, target_id, cache_id, a, b, payload)


def encode_text(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.int64)


def decode_text(payload: torch.Tensor) -> str:
    return bytes(payload.tolist()).decode()


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
    drafters and predictors use it unchanged. Creating one has every worker load
    (or reuse) the same checkpoint and shard it the same way.
    """

    def __init__(self, target: TargetModel, channel: Channel, path: str, dtype: str, model_impl: str):
        self._target = target
        self._channel = channel
        self._ids: dict[int, int] = {}  # id(cache) -> cache id shared with the workers
        self._freed: list[int] = []  # ids of collected caches, released with the next command
        self.target_id = channel.new_id()
        channel.send(LOAD, self.target_id, payload=encode_text(f"{dtype}\n{model_impl}\n{path}"))

    def __getattr__(self, name):
        return getattr(self._target, name)

    def new_cache(self) -> TargetCache:
        cache = self._target.new_cache()
        cache_id = self._channel.new_id()
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

    def _send(self, op: int, cache_id: int, payload: torch.Tensor | None = None, a: int = 0, b: int = 0) -> None:
        while self._freed:
            self._channel.send(FREE, self.target_id, self._freed.pop())
        self._channel.send(op, self.target_id, cache_id, payload, a, b)


def serve_target(load: Callable[[str, str, str], TargetModel], channel: Channel) -> int:
    """A worker rank: replay rank 0's target commands until STOP; returns the commands served.

    `load(path, dtype, model_impl)` loads and shards a checkpoint (once per distinct one).
    A ValueError from a command is the same check failing on rank 0 with the same
    inputs, raised before any collective: rank 0 reports it, the worker carries on.
    """
    loaded: dict[str, TargetModel] = {}
    targets: dict[int, TargetModel] = {}
    caches: dict[int, TargetCache] = {}
    while True:
        cmd = channel.recv()
        if cmd.op == STOP:
            return channel.count
        if cmd.op == LOAD:
            key = decode_text(cmd.payload)
            if key not in loaded:
                dtype, model_impl, path = key.split("\n", 2)
                loaded[key] = load(path, dtype, model_impl)
            targets[cmd.target_id] = loaded[key]
            continue
        try:
            _serve_one(targets[cmd.target_id], caches, cmd)
        except ValueError:
            continue


def _serve_one(target: TargetModel, caches: dict[int, TargetCache], cmd: Command) -> None:
    if cmd.op == NEW:
        caches[cmd.cache_id] = target.new_cache()
    elif cmd.op == FREE:
        caches.pop(cmd.cache_id, None)
    elif cmd.op == PREFILL:
        target.prefill(caches[cmd.cache_id], cmd.payload.reshape(1, -1).to(target.device), bool(cmd.a))
    elif cmd.op == VERIFY:
        target.verify(caches[cmd.cache_id], unpack_layout(cmd.payload, cmd.a, cmd.b, target.device))
    elif cmd.op == COMMIT:
        target.commit(caches[cmd.cache_id], cmd.payload.to(target.device))
    elif cmd.op == DISCARD:
        target.discard(caches[cmd.cache_id])
    else:
        raise RuntimeError(f"unknown command {cmd.op} from rank 0")
