"""CUDA graphs of the lean target forward: one per verify-length bucket (as EVICT captures one
verify graph per verify length, and TensorRT-LLM keys its graphs by draft length).

NOT YET RUN ON A GPU: this project's machines have none; `benchmarks/gpu_check.sh` is the
script that exercises it. On CPU the same static-shape forward (`LeanForward.forward_static`)
runs eagerly and is tested against the ordinary forward; only capture and replay are CUDA-only.

A verify of T tokens runs the graph of the smallest bucket >= T: token ids, positions and the
tree mask are copied into that graph's static input buffers, padded. Padded query rows see only
themselves; their keys land in cache slots past the real tree, which no real query's mask
admits and the next forward overwrites. The prefix length is a device tensor, so nothing is
read back to the host before the replay; attention spans the whole preallocated cache under a
mask, which is what keeps shapes static.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import StaticKVCache
from .lean_forward import LeanForward, LeanOutput


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # [1, T] static input buffers
    positions: torch.Tensor  # [1, T]
    prefix_len: torch.Tensor  # [1]
    tree_mask: torch.Tensor  # [1, T, T] bool
    output: LeanOutput  # static output tensors, valid after replay


class VerifyGraphs:
    """Captured lean forwards for one request slot, keyed by verify-length bucket (batch 1)."""

    def __init__(self, lean: LeanForward, cache: StaticKVCache, slot: int, buckets: tuple[int, ...]):
        if not cache.kv.is_cuda:
            raise ValueError("VerifyGraphs needs a CUDA cache (CPU runs use LeanForward.forward)")
        if not buckets or any(b < 1 for b in buckets):
            raise ValueError(f"verify-length buckets must be positive, got {buckets}")
        self.lean, self.cache, self.slot = lean, cache, slot
        self.buckets = tuple(sorted(set(buckets)))
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool shared by every bucket's graph
        self._graphs = {T: self._capture(T) for T in self.buckets}

    def bucket(self, num_tokens: int) -> int:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"verify of {num_tokens} tokens exceeds the largest captured bucket {self.buckets[-1]}")

    def _capture(self, T: int) -> _Graph:
        device = self.cache.kv.device
        ids = torch.zeros(1, T, dtype=torch.int64, device=device)
        pos = torch.zeros(1, T, dtype=torch.int64, device=device)
        prefix = torch.zeros(1, dtype=torch.int64, device=device)
        mask = torch.eye(T, dtype=torch.bool, device=device)[None]
        run = lambda: self.lean.forward_static(self.cache, ids, pos, (self.slot,), prefix, mask)  # noqa: E731
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, lazy inits)
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()
        return _Graph(graph, ids, pos, prefix, mask, out)

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, prefix_len: torch.Tensor,
            tree_mask: torch.Tensor | None) -> LeanOutput:
        """Replay the bucket graph for input_ids/positions [1, T] and tree_mask [1, T, T]
        (None = causal); prefix_len [1] on the device. Returns outputs sliced to the T real tokens."""
        T = input_ids.shape[1]
        g = self._graphs[self.bucket(T)]
        B = g.input_ids.shape[1]
        g.input_ids.fill_(0)
        g.input_ids[:, :T].copy_(input_ids)
        g.positions.copy_(positions[:, -1:].expand(1, B))
        g.positions[:, :T].copy_(positions)
        g.prefix_len.copy_(prefix_len)
        g.tree_mask.copy_(torch.eye(B, dtype=torch.bool, device=g.tree_mask.device)[None])
        if tree_mask is None:
            tree_mask = torch.ones(T, T, dtype=torch.bool, device=g.tree_mask.device).tril()[None]
        g.tree_mask[:, :T, :T].copy_(tree_mask)
        g.graph.replay()
        o = g.output
        return LeanOutput(logits=o.logits[:, :T], hidden=o.hidden[:, :T], expert_ids=o.expert_ids[:, :T])
