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

The capture machinery here (`_capture_graph`, `_Bucketed`, `GraphCaptureError`) is shared with
the EAGLE-3 drafter's static runners and graphs (`models/eagle3/graphs.py`, same pattern), which
import this module; this module imports nothing of the drafter.

Buckets: the cost profile is dense (C(k) for every k), so it names no verify lengths of its
own; the buckets are a power-of-two ladder capped by the tree's largest verify
(`verify_buckets`), the padding EVICT applies when it rounds a selection up to a captured length.
"""

from __future__ import annotations

import warnings
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
