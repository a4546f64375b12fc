"""Bucketed static-shape verify forwards of the lean target, and their CUDA graphs: one per
verify-length bucket (as EVICT captures one verify graph per verify length, and TensorRT-LLM
keys its graphs by draft length).

NOT YET RUN ON A GPU: this project's machines have none; `benchmarks/gpu_check.sh` is the
script that exercises it. On CPU the very same bucketed call (`StaticVerify`, the function the
graph captures) runs eagerly and is tested against the ordinary forward and, through the
engine, against plain decoding; only capture and replay (`VerifyGraphs`) are CUDA-only.

A forward of T tokens runs the smallest bucket >= T: token ids, positions, the prefix length
and the tree mask are copied into that bucket's static input buffers, padded. Padded query
rows see only themselves (and the committed prefix); their keys land in cache slots past the
real tree, which no real query's mask admits and the next forward overwrites. The prefix
length is a device tensor filled from the host int the engine already holds, so nothing is
read back to the host before the replay; attention spans the whole preallocated cache under
a mask, which is what keeps shapes static.

The drafter has two static runners of its own (section below, same pattern): its per-step
extension over the committed tokens (`StaticDrafterExtend` / `DrafterGraphs`, a graph per length
bucket) and its tree-drafting steps (`StaticDrafterFrontier` / `DrafterFrontierGraphs`: the
frontier padded to topk rows, ONE graph, replayed for every drafting step). Drafter graphs are
bound to the drafter K/V buffer they were captured over, so they are kept per buffer
(`DrafterGraphStore`), and buffers are reused across requests (`eagle3.DrafterKVPool`): requests
served one at a time replay one buffer's graphs, each captured once. The CPU engine uses neither
runner unless a test sets one ("static": the same calls eagerly).

Buckets: the cost profile is dense (C(k) for every k), so it names no verify lengths of its
own; the buckets are a power-of-two ladder capped by the tree's largest verify
(`verify_buckets`), the padding EVICT applies when it rounds a selection up to a captured length.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import torch

from .kv_cache import StaticKVCache
from .lean_forward import LeanForward, LeanOutput

DEFAULT_LADDER = (1, 2, 4, 8, 16, 32, 64)


def verify_buckets(max_draft_tokens: int, ladder: tuple[int, ...] = DEFAULT_LADDER) -> tuple[int, ...]:
    """Verify-length buckets for trees of up to `max_draft_tokens` nodes: the ladder below the
    largest verify (root + every node) and that largest verify itself, so no verify is ever
    padded past what the tree can need."""
    if max_draft_tokens < 0:
        raise ValueError(f"max_draft_tokens must be >= 0, got {max_draft_tokens}")
    top = max_draft_tokens + 1
    return tuple(sorted({b for b in ladder if b < top} | {top}))


class _Bucketed:
    """Forwards padded to the smallest of a fixed set of lengths (on CUDA, one graph per length)."""

    buckets: tuple[int, ...]
    _what = "forward"  # named in errors

    def _set_buckets(self, buckets: tuple[int, ...]) -> None:
        if not buckets or any(b < 1 for b in buckets):
            raise ValueError(f"{self._what} buckets must be positive, got {buckets}")
        self.buckets = tuple(sorted(set(buckets)))

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def bucket(self, num_tokens: int) -> int:
        """The smallest bucket that holds `num_tokens` rows."""
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"a {self._what} of {num_tokens} tokens exceeds the largest bucket {self.buckets[-1]}")


@dataclass
class _Bucket:
    """The static input buffers of one bucket (and, on CUDA, its graph and static outputs)."""

    input_ids: torch.Tensor  # [1, B] int64
    positions: torch.Tensor  # [1, B] int64
    prefix_len: torch.Tensor  # [1] int64
    tree_mask: torch.Tensor  # [1, B, B] bool
    eye: torch.Tensor  # [1, B, B] bool, the padded rows' mask (each sees itself)
    causal: torch.Tensor  # [1, B, B] bool lower triangle (a forward without a tree)
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    output: LeanOutput | None = None  # the graph's static outputs, valid after a replay


class StaticVerify(_Bucketed):
    """Forwards of one request slot (batch 1) through the static-shape lean forward of the
    smallest bucket that holds them. `_call` is exactly what `VerifyGraphs` captures; this class
    runs it eagerly (CPU, and the reference its graph is checked against)."""

    _what = "verify-length"

    def __init__(self, lean: LeanForward, cache: StaticKVCache, slot: int, buckets: tuple[int, ...]):
        self._set_buckets(buckets)
        self.lean, self.cache, self.slot = lean, cache, slot
        self._buckets: dict[int, _Bucket] = {}

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, prefix_len: int | torch.Tensor,
            tree_mask: torch.Tensor | None) -> LeanOutput:
        """Forward input_ids/positions [1, T] after `prefix_len` committed keys (a host int, or a
        [1] device tensor: then the caller makes sure the cache holds prefix + bucket positions),
        tree_mask [1, T, T] bool (None = causal). Returns the T real tokens' outputs (all logits),
        owned by the caller."""
        T = input_ids.shape[1]
        B = self.bucket(T)
        if isinstance(prefix_len, int):  # the host knows it: room for the padded keys, no device read
            self.cache.ensure_len(prefix_len + B)
        buf = self._buffers(B)
        self._fill(buf, input_ids, positions, prefix_len, tree_mask)
        out = self._execute(buf)
        # Copies: a graph's outputs are overwritten by the next replay, and the engine keeps some
        # (the drafter's deferred hiddens) across steps.
        return LeanOutput(logits=out.logits[:, :T].clone(), hidden=out.hidden[:, :T].clone(),
                          expert_ids=out.expert_ids[:, :T].clone())

    def _buffers(self, B: int) -> _Bucket:
        buf = self._buckets.get(B)
        if buf is None:
            device = self.cache.kv.device
            eye = torch.eye(B, dtype=torch.bool, device=device)[None]
            buf = _Bucket(input_ids=torch.zeros(1, B, dtype=torch.int64, device=device),
                          positions=torch.zeros(1, B, dtype=torch.int64, device=device),
                          prefix_len=torch.zeros(1, dtype=torch.int64, device=device),
                          tree_mask=eye.clone(), eye=eye, causal=torch.ones_like(eye).tril())
            self._buckets[B] = buf
        return buf

    @staticmethod
    def _fill(buf: _Bucket, input_ids, positions, prefix_len, tree_mask) -> None:
        """Copy one forward's inputs into the bucket's buffers, padded (device copies only)."""
        T, B = input_ids.shape[1], buf.input_ids.shape[1]
        buf.input_ids.zero_()
        buf.input_ids[:, :T].copy_(input_ids)
        buf.positions.copy_(positions[:, -1:].expand(1, B))  # padded rows: any in-range position
        buf.positions[:, :T].copy_(positions)
        if isinstance(prefix_len, int):
            buf.prefix_len.fill_(prefix_len)
        else:
            buf.prefix_len.copy_(prefix_len.reshape(1))
        buf.tree_mask.copy_(buf.eye)
        if tree_mask is None:  # causal among the real tokens
            buf.tree_mask[:, :T, :T].copy_(buf.causal[:, :T, :T])
        else:
            buf.tree_mask[:, :T, :T].copy_(tree_mask)

    def _call(self, buf: _Bucket) -> LeanOutput:
        """The static-shape forward over the bucket's buffers: what a CUDA graph captures."""
        return self.lean.forward_static(self.cache, buf.input_ids, buf.positions, (self.slot,), buf.prefix_len,
                                        buf.tree_mask)

    def _execute(self, buf: _Bucket) -> LeanOutput:
        return self._call(buf)


class VerifyGraphs(StaticVerify):
    """`StaticVerify` with each bucket's call captured as a CUDA graph on first use and replayed
    after. All graphs share one memory pool. Growing the cache (or the rotary table) moves
    tensors the graphs point at, so every graph is dropped and recaptured lazily."""

    def __init__(self, lean: LeanForward, cache: StaticKVCache, slot: int, buckets: tuple[int, ...],
                 capture=None):
        """`capture`: `_capture_graph` (CUDA, the default); tests of the bookkeeping pass a stand-in."""
        if capture is None and not cache.kv.is_cuda:
            raise ValueError("VerifyGraphs needs a CUDA cache (use StaticVerify on CPU)")
        super().__init__(lean, cache, slot, buckets)
        self._capture = capture or _capture_graph
        self.pool = torch.cuda.graph_pool_handle() if capture is None else None
        self._captured_for: tuple[torch.Tensor, object] | None = None
        self.captures = 0  # graphs captured so far (recaptures after growth included)

    def _execute(self, buf: _Bucket) -> LeanOutput:
        current = (self.cache.kv, self.lean._cos)
        if self._captured_for is not None and (current[0] is not self._captured_for[0]
                                               or current[1] is not self._captured_for[1]):
            for b in self._buckets.values():  # the graphs point at the old cache: recapture lazily
                b.graph, b.output = None, None
        if buf.graph is None:
            try:
                buf.graph, buf.output = self._capture(lambda: self._call(buf), self.pool)
            except Exception as e:  # a kernel that cannot be captured, or out of memory
                raise GraphCaptureError(str(e)) from e
            self._captured_for = (self.cache.kv, self.lean._cos)
            self.captures += 1
        buf.graph.replay()
        return buf.output


RUNNER_KINDS = ("graphs", "static")


class GraphCaptureError(RuntimeError):
    """Capturing a bucket's CUDA graph failed (the caller falls back to the eager forward)."""


def make_runner(kind: str, lean: LeanForward, cache: StaticKVCache, slot: int,
                buckets: tuple[int, ...]) -> StaticVerify:
    """"graphs": CUDA graphs per bucket (CUDA only); "static": the same bucketed call run eagerly."""
    return _runner_class(kind, VerifyGraphs, StaticVerify)(lean, cache, slot, buckets)


def _runner_class(kind: str, graphs: type, static: type) -> type:
    if kind not in RUNNER_KINDS:
        raise ValueError(f"runner kind must be one of {', '.join(RUNNER_KINDS)}, got {kind!r}")
    return graphs if kind == "graphs" else static


def warn_fallback(error: BaseException, forward: str = "verify forward") -> None:
    """The one warning printed when graph capture fails and that forward falls back to eager."""
    warnings.warn(f"CUDA graph capture of the {forward} failed ({type(error).__name__}: {error}); "
                  f"running the {forward} eagerly from now on", RuntimeWarning, stacklevel=3)


def _capture_graph(call, pool) -> tuple[object, object]:
    """(graph, its static outputs) of `call()`: two warm-up runs on a side stream (allocator, lazy
    inits, tables), then the capture into `pool`. The warm-ups run the call for real: callers
    capture only calls whose side effects the replay repeats identically (same inputs).

    The second warm-up runs with torch's sync debug mode set to "error": an op that reads the
    device from the host (`.item()`, `.cpu()`, `nonzero`; e.g. torch's grouped_mm outside its
    bf16 sm90/sm100 kernel copies the group offsets to the host) raises there, before any capture,
    instead of inside it. A capture that fails anyway is unwound (`_abandon_capture`)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            call()  # first use: lazy inits (tables, handles, kernel builds) may synchronise here
            _run_without_host_syncs(call)
    finally:  # also on failure: the eager fallback must not race the warm-ups' writes
        torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    caller = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = call()
    except BaseException:
        _abandon_capture(graph, caller, pool)
        raise
    return graph, out


def _run_without_host_syncs(call) -> None:
    """call() with every host synchronisation an error ("called a synchronizing CUDA operation"):
    a capture could not hold it."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _abandon_capture(graph, caller_stream, pool) -> None:
    """Undo what a failed capture leaves behind, so that the eager fallback and later captures run
    normally. torch (2.11 and earlier) raises out of `capture_end` before it ends the capture's
    routing of allocations to the graph's pool (a later `empty_cache`, which every capture calls,
    then fails torch's assert that no capture is underway), before `torch.cuda.graph` gives the
    caller its stream back, and before the CUDA RNG states registered with the graph leave capture
    mode (where that mode is one flag, later eager random ops then raise). Best effort: on versions
    that clean up themselves each step is a no-op."""
    _end_capture_state(graph, caller_stream, pool)
    closing = graph
    try:  # a capture that ends normally takes the RNG out of the capture mode the failed one left
        scratch = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
        closing = torch.cuda.CUDAGraph()
        with torch.cuda.graph(closing, pool=pool):
            scratch.add_(1)
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        _end_capture_state(closing, caller_stream, pool)


def _end_capture_state(graph, caller_stream, pool) -> None:
    """The caller's stream back, and allocations no longer routed to the capture's pool."""
    try:
        torch.cuda.set_stream(caller_stream)
    except Exception:  # noqa: BLE001
        pass
    end_routing = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end_routing is None:
        return
    try:
        end_routing(torch.cuda.current_device(), pool if pool is not None else graph.pool())
    except Exception:  # noqa: BLE001 (not routed any more: torch ended it)
        pass


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
    (`eagle3.DrafterKVPool`), so a sequence of requests replays the graphs of one buffer and a batch
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
    forward (`eagle3_static.py`) of the smallest bucket >= n, over the cache's whole K/V buffer.
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
        from .eagle3 import Eagle3Output

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
        from .eagle3_static import extension_inputs, static_drafter_forward

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
    """The tree-drafting forwards of `eagle3_draft.draft_eagle3_tree` through the static-shape drafter
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
        from .eagle3 import Eagle3Output

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
        from .eagle3_static import static_drafter_forward

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
