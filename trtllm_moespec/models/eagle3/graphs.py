"""Static-shape runners of the EAGLE-3 drafter's forwards, and their CUDA graphs (the same pattern as
the target's verify graphs in `models/cuda_graphs.py`, whose capture machinery they share): its
per-step extension over the committed tokens (`StaticDrafterExtend` / `DrafterGraphs`, a graph per
length bucket) and its tree-drafting steps (`StaticDrafterFrontier` / `DrafterFrontierGraphs`: the
frontier padded to topk rows, ONE graph, replayed for every drafting step). Drafter graphs are bound
to the drafter K/V buffer they were captured over, so they are kept per buffer (`DrafterGraphStore`),
and buffers are reused across requests (`cache.DrafterKVPool`): requests served one at a time replay
one buffer's graphs, each captured once. The CPU engine uses neither runner unless a test sets one
("static": the same calls eagerly).

NOT YET RUN ON A GPU (see `models/cuda_graphs.py`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..cuda_graphs import GraphCaptureError, _Bucketed, _capture_graph, _runner_class
from .static import extension_inputs, static_drafter_forward
from .types import Eagle3Output


def _drafter_tables(drafter) -> tuple:
    """What every drafter graph points at besides its inputs and K/V buffer: the signed rope table
    and the fused weights (a first forward builds them; a long position grows the table; reloaded
    weights replace them). The objects themselves, compared by identity (`_same`): holding them
    keeps their memory from being reused while a graph still points at it."""
    table = drafter._rope_signed_table
    return None if table is None else table[1], drafter._fused


def _same(a: tuple | None, b: tuple) -> bool:
    return a is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b))


class DrafterGraphStore:
    """A drafter runner's captured graphs, kept per K/V buffer: a graph writes its keys into the
    buffer it was captured over, so each buffer needs its own. Buffers are reused across requests
    (`cache.DrafterKVPool`), so a sequence of requests replays the graphs of one buffer and a batch
    of B requests those of B buffers, each captured once. A buffer's graphs go when the buffer is
    freed (the store holds it weakly: its memory may then be reused, and a graph must never write
    into it again); every graph goes when the drafter's tables are replaced (`_drafter_tables`) or
    the runner's static inputs are (`clear`). `capture` is `_capture_graph` (CUDA); tests of this
    bookkeeping pass a stand-in."""

    def __init__(self, drafter, pool, capture=None):
        self.drafter, self.pool = drafter, pool
        self._capture = capture or _capture_graph
        self._tables: tuple | None = None
        self._by_buffer: dict[int, tuple[weakref.ref, dict]] = {}  # id(kv) -> (weak kv, name -> (graph, out))
        self.captures = 0

    def replay(self, kv: torch.Tensor, name, call):
        """Replay graph `name` over buffer kv, capturing `call()` first if it has none; returns
        the graph's static outputs."""
        self._check_tables()
        graphs = self._graphs(kv)
        if name not in graphs:
            try:
                captured = self._capture(call, self.pool)  # (graph, its static outputs)
            except Exception as e:
                raise GraphCaptureError(str(e)) from e
            self._check_tables()  # the warm-ups may have built the tables: older graphs point at none
            graphs = self._graphs(kv)
            graphs[name] = captured
            self.captures += 1
        graph, output = graphs[name]
        graph.replay()
        return output

    def clear(self) -> None:
        self._by_buffer.clear()

    @property
    def num_buffers(self) -> int:
        return len(self._by_buffer)

    def _graphs(self, kv: torch.Tensor) -> dict:
        key = id(kv)
        entry = self._by_buffer.get(key)
        if entry is None or entry[0]() is not kv:
            entries = self._by_buffer

            def forget(_ref, key=key):  # kv is being freed: its graphs go with it
                if key in entries and entries[key][0] is _ref:
                    del entries[key]
            entry = self._by_buffer[key] = (weakref.ref(kv, forget), {})
        return entry[1]

    def _check_tables(self) -> None:
        tables = _drafter_tables(self.drafter)
        if not _same(self._tables, tables):
            self.clear()
            self._tables = tables


# ---------------------------------------------------------------------------------------------
# Drafter extensions (commit / catch-up): the drafter forward over the n tokens a step committed


@dataclass
class _ExtendBucket:
    input_ids: torch.Tensor  # [1, B] int64
    hidden: torch.Tensor  # [1, B, W] target features
    start: torch.Tensor  # [1] int64 committed drafter positions


class StaticDrafterExtend(_Bucketed):
    """Drafter cache extensions by n <= max(buckets) positions through the static-shape drafter
    forward (`static.py`) of the smallest bucket >= n, over the cache's whole K/V buffer.
    `_call` is what `DrafterGraphs` captures; this class runs it eagerly (the CPU reference)."""

    _what = "extension"

    def __init__(self, drafter, buckets: tuple[int, ...]):
        self._set_buckets(buckets)
        self.drafter = drafter
        self._buckets: dict[int, _ExtendBucket] = {}

    @torch.no_grad()
    def run(self, kv: torch.Tensor, start: int, token_ids: torch.Tensor, hidden: torch.Tensor):
        """Extend the drafter K/V buffer kv [2, 1, KVH, capacity, D] (capacity >= start + bucket)
        by token_ids [1, n] paired with hidden [1, n, W]; returns the n real rows' Eagle3Output."""
        n = token_ids.shape[1]
        B = self.bucket(n)
        if kv.shape[3] < start + B:
            raise ValueError(f"the drafter buffer holds {kv.shape[3]} positions, the bucket needs {start + B}")
        buf = self._buffers(B, hidden)
        buf.input_ids.zero_()
        buf.input_ids[:, :n].copy_(token_ids)
        buf.hidden.zero_()
        buf.hidden[:, :n].copy_(hidden)
        buf.start.fill_(start)
        out = self._execute(buf, kv)
        return Eagle3Output(logits=out.logits[:, :n].clone(), hidden=out.hidden[:, :n].clone(),
                            keys=out.keys[:, :, :n].clone(), values=out.values[:, :, :n].clone())

    def _buffers(self, B: int, hidden: torch.Tensor) -> _ExtendBucket:
        old = buf = self._buckets.get(B)
        if buf is None or buf.hidden.shape[-1] != hidden.shape[-1] or buf.hidden.dtype != hidden.dtype:
            device = hidden.device
            buf = _ExtendBucket(input_ids=torch.zeros(1, B, dtype=torch.int64, device=device),
                                hidden=hidden.new_zeros(1, B, hidden.shape[-1]),
                                start=torch.zeros(1, dtype=torch.int64, device=device))
            self._buckets[B] = buf
            if old is not None:  # a first bucket replaces nothing; graphs of the other buckets stay
                self._inputs_replaced()
        return buf

    def _inputs_replaced(self) -> None:
        """New static input buffers (a graph captured over the old ones must not replay)."""

    def _call(self, buf: _ExtendBucket, kv: torch.Tensor):
        positions, write_idx, visible = extension_inputs(buf.start, buf.input_ids.shape[1], kv.shape[3])
        return static_drafter_forward(self.drafter, kv, buf.hidden, buf.input_ids, positions, write_idx, visible)

    def _execute(self, buf: _ExtendBucket, kv: torch.Tensor):
        return self._call(buf, kv)


class _StoredGraphs:
    """What the drafter's graph runners share: their graphs live in a `DrafterGraphStore`."""

    graphs: DrafterGraphStore

    def _attach_store(self, drafter, graphs: DrafterGraphStore | None, eager: str) -> None:
        """`graphs`: the store (default: CUDA capture into a new graph pool; tests of the bookkeeping
        pass a store with a stand-in capture); `eager` names the runner to use on CPU instead."""
        if graphs is None:
            if not drafter.lm_head.weight.is_cuda:
                raise ValueError(f"{type(self).__name__} needs a drafter on a CUDA device (use {eager} on CPU)")
            graphs = DrafterGraphStore(drafter, torch.cuda.graph_pool_handle())
        self.graphs = graphs

    @property
    def captures(self) -> int:
        return self.graphs.captures

    def _inputs_replaced(self) -> None:
        self.graphs.clear()


class DrafterGraphs(_StoredGraphs, StaticDrafterExtend):
    """`StaticDrafterExtend` with each bucket captured as a CUDA graph on first use, per drafter
    K/V buffer (`DrafterGraphStore`). NOT YET RUN ON A GPU."""

    def __init__(self, drafter, buckets: tuple[int, ...], graphs: DrafterGraphStore | None = None):
        self._attach_store(drafter, graphs, "StaticDrafterExtend")
        super().__init__(drafter, buckets)

    def _execute(self, buf: _ExtendBucket, kv: torch.Tensor):
        # Capture's warm-ups write this extension's keys, which the replay writes again (same inputs).
        return self.graphs.replay(kv, buf.input_ids.shape[1], lambda: self._call(buf, kv))


def make_drafter_runner(kind: str, drafter, buckets: tuple[int, ...]) -> StaticDrafterExtend:
    """"graphs": CUDA graphs of the drafter's extension forwards; "static": the same call eagerly."""
    return _runner_class(kind, DrafterGraphs, StaticDrafterExtend)(drafter, buckets)


# ---------------------------------------------------------------------------------------------
# Tree-drafting forwards: one drafter forward per drafting step over the frontier (F <= topk rows)


@dataclass
class _FrontierBuffers:
    """The static inputs of a frontier forward padded to `width` rows over a buffer of `capacity`."""

    hidden: torch.Tensor  # [1, width, H] drafter hidden of the forward that proposed each frontier node
    input_ids: torch.Tensor  # [1, width] int64
    positions: torch.Tensor  # [1, width] int64 (one drafting step: every row at the same position)
    rows: torch.Tensor  # [width] int64 0..width-1 (constant)
    write_idx: torch.Tensor  # [width] int64 cache index of each row's key
    visible: torch.Tensor  # [1, width, capacity] bool


class StaticDrafterFrontier:
    """The tree-drafting forwards of `drafting.draft_eagle3_tree` through the static-shape drafter
    forward: the frontier (F <= width rows; the drafting loop's frontier is at most topk wide) padded
    to `width` rows, attending over the drafter's whole K/V buffer under a visibility mask built from
    the loop's own tree mask. Padded rows see only their own key, written at the cache indices right
    after the real rows' (scratch the next step overwrites and no real row sees). Shapes depend only
    on `width` and the buffer's capacity, so `DrafterFrontierGraphs` captures ONE graph per buffer.
    `_call` is what it captures; this class runs it eagerly (the CPU reference)."""

    def __init__(self, drafter, width: int):
        if width < 1:
            raise ValueError(f"the frontier width must be >= 1, got {width}")
        self.drafter, self.width = drafter, width
        self._bufs: dict[int, _FrontierBuffers] = {}  # by buffer capacity (the visibility mask's width)

    @torch.no_grad()
    def run(self, kv: torch.Tensor, hidden: torch.Tensor, input_ids: torch.Tensor, position: int, start: int,
            tree_mask: torch.Tensor):
        """One drafting step over kv [2, 1, KVH, capacity, D]: frontier features hidden [1, F, H] and
        tokens input_ids [1, F] at `position`, keys written at start.. (host ints the loop holds),
        tree_mask the loop's additive [1, 1, F, start + F] mask (0 = visible). Returns the F real
        rows' Eagle3Output as views that the next run overwrites (the loop consumes them at once)."""
        F_ = input_ids.shape[1]
        if F_ < 1 or F_ > self.width:
            raise ValueError(f"a frontier of {F_} rows does not fit a forward of {self.width} rows")
        if tree_mask.shape[-2:] != (F_, start + F_):
            raise ValueError(f"tree mask {tuple(tree_mask.shape)} does not match {F_} rows written at {start}")
        if kv.shape[3] < start + self.width:
            raise ValueError(f"the drafter buffer holds {kv.shape[3]} positions, the padded frontier needs "
                             f"{start + self.width}")
        buf = self._buffers(kv, hidden)
        self._fill(buf, hidden, input_ids, position, start, tree_mask)
        out = self._execute(buf, kv)
        return Eagle3Output(logits=out.logits[:, :F_], hidden=out.hidden[:, :F_], keys=out.keys[:, :, :F_],
                            values=out.values[:, :, :F_])

    def _buffers(self, kv: torch.Tensor, hidden: torch.Tensor) -> _FrontierBuffers:
        W, capacity = self.width, kv.shape[3]
        some = next(iter(self._bufs.values()), None)
        if some is not None and (some.hidden.shape[-1] != hidden.shape[-1] or some.hidden.dtype != hidden.dtype
                                 or some.hidden.device != kv.device):
            self._bufs.clear()
            self._inputs_replaced()
        buf = self._bufs.get(capacity)
        if buf is None:
            device = kv.device
            rows = torch.arange(W, device=device)
            buf = self._bufs[capacity] = _FrontierBuffers(
                hidden=torch.zeros(1, W, hidden.shape[-1], dtype=hidden.dtype, device=device),
                input_ids=torch.zeros(1, W, dtype=torch.int64, device=device),
                positions=torch.zeros(1, W, dtype=torch.int64, device=device),
                rows=rows, write_idx=rows.clone(),
                visible=torch.zeros(1, W, capacity, dtype=torch.bool, device=device))
        return buf

    def _inputs_replaced(self) -> None:
        """New static input buffers (a graph captured over the old ones must not replay)."""

    @staticmethod
    def _fill(buf: _FrontierBuffers, hidden, input_ids, position: int, start: int, tree_mask) -> None:
        """Copy one step's inputs into the static buffers, padded (device copies only, no reads)."""
        F_, W = input_ids.shape[1], buf.input_ids.shape[1]
        buf.hidden[:, :F_].copy_(hidden)
        buf.hidden[:, F_:].zero_()
        buf.input_ids[:, :F_].copy_(input_ids)
        buf.input_ids[:, F_:].zero_()
        buf.positions.fill_(position)
        torch.add(buf.rows, start, out=buf.write_idx)
        buf.visible.zero_()
        buf.visible[0, :F_, :start + F_].copy_(tree_mask[0, 0] == 0)
        buf.visible[0, F_:, start + F_:start + W].diagonal().fill_(True)  # padded rows: their own key only

    def _call(self, buf: _FrontierBuffers, kv: torch.Tensor):
        return static_drafter_forward(self.drafter, kv, buf.hidden, buf.input_ids, buf.positions, buf.write_idx,
                                      buf.visible)

    def _execute(self, buf: _FrontierBuffers, kv: torch.Tensor):
        return self._call(buf, kv)


class DrafterFrontierGraphs(_StoredGraphs, StaticDrafterFrontier):
    """`StaticDrafterFrontier` captured as ONE CUDA graph (the frontier's fixed width) per drafter K/V
    buffer on first use (`DrafterGraphStore`) and replayed for every drafting step after. NOT YET
    RUN ON A GPU."""

    def __init__(self, drafter, width: int, graphs: DrafterGraphStore | None = None):
        self._attach_store(drafter, graphs, "StaticDrafterFrontier")
        super().__init__(drafter, width)
        self.replays = 0  # drafting steps run from a graph

    def _execute(self, buf: _FrontierBuffers, kv: torch.Tensor):
        # Capture's warm-ups write this step's keys, which the replay writes again (same inputs).
        out = self.graphs.replay(kv, "frontier", lambda: self._call(buf, kv))
        self.replays += 1
        return out


def make_frontier_runner(kind: str, drafter, width: int) -> StaticDrafterFrontier:
    """"graphs": one CUDA graph of the tree-drafting forward (CUDA only); "static": the same call eagerly."""
    return _runner_class(kind, DrafterFrontierGraphs, StaticDrafterFrontier)(drafter, width)
