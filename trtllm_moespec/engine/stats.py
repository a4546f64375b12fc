"""Per-step records and their aggregate, with the metric names of DESIGN.md."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class StepStats:
    """One speculative iteration."""

    verified_tokens: int  # draft nodes verified (root excluded)
    accepted_tokens: int  # draft nodes accepted
    committed_tokens: int  # tokens emitted: accepted + bonus (Mat counts this)
    unique_experts_per_layer: float  # mean over MoE layers of distinct experts the verify forward woke
    draft_ms: float  # drafter forwards: the tree, plus extending its cache by the committed tokens
    predictor_ms: float
    select_ms: float
    verify_ms: float  # target forward + acceptance rule
    target_ms: float  # the target forward alone (part of verify_ms)
    commit_ms: float  # target KV compaction
    step_ms: float  # wall time of the whole iteration
    predictor_hits: int = 0  # predicted (layer, expert) pairs that the target really used, accepted nodes
    predictor_total: int = 0  # predicted pairs checked
    speculated: bool = True  # False: a plain step chosen by the speculate-or-not rule (nothing drafted)
    scouted: bool = False  # a plain step whose probe the guard's scout stopped (its drafter catch-up ran)
    unique_experts_per_rank: tuple[float, ...] = ()  # EP: distinct experts per rank, mean over MoE layers
    busiest_rank_experts_per_layer: float | None = None  # EP: U_max / L, each layer's busiest rank, mean over layers


@dataclass(frozen=True)
class GenerationStats:
    """Aggregate over one request (or several, via merge)."""

    num_steps: int
    num_tokens: int  # generated tokens (after truncation to max_tokens / stop)
    prefill_ms: float
    decode_s: float  # wall time of all iterations
    tokens_per_s: float  # generated tokens / (prefill + decode) time
    mean_accepted_tokens: float  # Mat: committed tokens per iteration, bonus included
    verified_tokens: float  # mean draft nodes verified per iteration
    unique_experts_per_layer: float
    draft_ms: float  # means per iteration
    predictor_ms: float
    select_ms: float
    verify_ms: float
    target_ms: float
    commit_ms: float
    overhead_ms: float  # step time not spent in draft / predictor / select / verify / commit
    predictor_topk_acc: float | None
    acceptance_lengths: tuple[int, ...]  # committed tokens per iteration
    num_draft_tokens: tuple[int, ...]  # verified nodes per iteration
    unique_experts_per_rank: tuple[float, ...] = ()  # EP: per rank, mean over MoE layers and iterations
    busiest_rank_experts_per_layer: float | None = None  # EP: mean over iterations of U_max / L

    @staticmethod
    def from_steps(steps: list[StepStats], num_tokens: int, prefill_ms: float) -> "GenerationStats":
        n = max(len(steps), 1)
        mean = lambda f: float(sum(getattr(s, f) for s in steps) / n)  # noqa: E731
        decode_s = sum(s.step_ms for s in steps) / 1e3
        total_s = decode_s + prefill_ms / 1e3
        hits = sum(s.predictor_hits for s in steps)
        checked = sum(s.predictor_total for s in steps)
        parts = ("draft_ms", "predictor_ms", "select_ms", "verify_ms", "commit_ms")
        return GenerationStats(
            num_steps=len(steps),
            num_tokens=num_tokens,
            prefill_ms=prefill_ms,
            decode_s=decode_s,
            tokens_per_s=num_tokens / total_s if total_s > 0 else 0.0,
            mean_accepted_tokens=mean("committed_tokens"),
            verified_tokens=mean("verified_tokens"),
            unique_experts_per_layer=mean("unique_experts_per_layer"),
            **{p: mean(p) for p in parts},
            target_ms=mean("target_ms"),
            overhead_ms=mean("step_ms") - sum(mean(p) for p in parts),
            predictor_topk_acc=hits / checked if checked else None,
            acceptance_lengths=tuple(s.committed_tokens for s in steps),
            num_draft_tokens=tuple(s.verified_tokens for s in steps),
            **_per_rank_means(steps),
        )

    @property
    def bookkeeping_fraction(self) -> float:
        """Share of step time outside the draft forward, the predictor, the policy and the
        target forward: the engine's own work (layout, acceptance rule, KV commit, stats)."""
        step = self.decode_s * 1e3 / max(self.num_steps, 1)
        model = self.draft_ms + self.predictor_ms + self.select_ms + self.target_ms
        return max(step - model, 0.0) / step if step > 0 else 0.0

    @staticmethod
    def merge(stats: list["GenerationStats"]) -> "GenerationStats":
        """Aggregate several requests: step-weighted means, token-weighted speed."""
        steps = sum(s.num_steps for s in stats) or 1
        w = lambda f: float(sum(getattr(s, f) * s.num_steps for s in stats) / steps)  # noqa: E731
        tokens = sum(s.num_tokens for s in stats)
        total_s = sum(s.decode_s + s.prefill_ms / 1e3 for s in stats)
        accs = [s.predictor_topk_acc for s in stats if s.predictor_topk_acc is not None]
        return GenerationStats(
            num_steps=sum(s.num_steps for s in stats), num_tokens=tokens,
            prefill_ms=sum(s.prefill_ms for s in stats), decode_s=sum(s.decode_s for s in stats),
            tokens_per_s=tokens / total_s if total_s > 0 else 0.0,
            mean_accepted_tokens=w("mean_accepted_tokens"), verified_tokens=w("verified_tokens"),
            unique_experts_per_layer=w("unique_experts_per_layer"), draft_ms=w("draft_ms"),
            predictor_ms=w("predictor_ms"), select_ms=w("select_ms"), verify_ms=w("verify_ms"), target_ms=w("target_ms"),
            commit_ms=w("commit_ms"), overhead_ms=w("overhead_ms"),
            predictor_topk_acc=float(np.mean(accs)) if accs else None,
            acceptance_lengths=tuple(x for s in stats for x in s.acceptance_lengths),
            num_draft_tokens=tuple(x for s in stats for x in s.num_draft_tokens),
            **_merge_per_rank(stats),
        )

    def summary(self) -> str:
        """The one-line stats summary the CLI prints."""
        acc = f", predictor acc {self.predictor_topk_acc:.0%}" if self.predictor_topk_acc is not None else ""
        if self.busiest_rank_experts_per_layer is not None:
            acc += (f" | per EP rank {'/'.join(f'{x:.1f}' for x in self.unique_experts_per_rank)}, "
                    f"busiest {self.busiest_rank_experts_per_layer:.1f}")
        return (f"{self.num_tokens} tokens in {self.decode_s + self.prefill_ms / 1e3:.2f}s = {self.tokens_per_s:.1f} tok/s | "
                f"Mat {self.mean_accepted_tokens:.2f} | verified/step {self.verified_tokens:.1f} | "
                f"unique experts/layer {self.unique_experts_per_layer:.1f}{acc}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_lengths"] = list(self.acceptance_lengths)
        d["num_draft_tokens"] = list(self.num_draft_tokens)
        return d


def _per_rank_means(steps: list[StepStats]) -> dict:
    """EP fields of GenerationStats (empty without expert parallelism)."""
    ep = [s for s in steps if s.busiest_rank_experts_per_layer is not None]
    if not ep:
        return {}
    return {"unique_experts_per_rank": tuple(np.mean([s.unique_experts_per_rank for s in ep], axis=0).tolist()),
            "busiest_rank_experts_per_layer": float(np.mean([s.busiest_rank_experts_per_layer for s in ep]))}


def _merge_per_rank(stats: list[GenerationStats]) -> dict:
    ep = [s for s in stats if s.busiest_rank_experts_per_layer is not None]
    if not ep:
        return {}
    w = np.array([s.num_steps for s in ep], dtype=float)
    w = w / w.sum() if w.sum() else np.full(len(ep), 1.0 / len(ep))
    return {"unique_experts_per_rank": tuple((w[:, None] * np.array([s.unique_experts_per_rank for s in ep])).sum(0).tolist()),
            "busiest_rank_experts_per_layer": float((w * np.array([s.busiest_rank_experts_per_layer for s in ep])).sum())}
