"""Deliberately broken acceptance rules ("mutants"), each applied by monkeypatching the real verifier.

A test suite that claims losslessness must fail under every one of them; `python -m tests.mutants`
runs the distribution and exactness tests under each and fails unless all are killed.

Each mutant patches the verifier's own helpers in `trtllm_moespec.core.verify` (looked up at call
time, so every caller of `verify_tree` sees the change, whatever it imported), and counts the calls
where the break really changed something: a mutant that is never exercised proves nothing and is
reported as such, not as killed. Adding a mutant for a new sampling path (for example a
position-keyed seeded sampler) is one more function decorated with `@mutant(...)`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import trtllm_moespec.core.verify as verify
from trtllm_moespec.core.seeded import PositionKeys

# name -> calls where the mutation changed what the verifier saw or did
HITS: Counter[str] = Counter()


@dataclass(frozen=True)
class Mutant:
    name: str
    doc: str  # what is broken, in one line
    kind: str  # "sampled" or "greedy": which tests the check runs first (those that should kill it)
    apply: Callable[[pytest.MonkeyPatch], None]  # installs the break on the given patcher


MUTANTS: dict[str, Mutant] = {}


def mutant(name: str, doc: str, kind: str = "sampled"):
    """Register `fn(monkeypatch)` as the mutant `name`."""
    assert kind in ("sampled", "greedy"), kind

    def register(fn: Callable[[pytest.MonkeyPatch], None]) -> Callable[[pytest.MonkeyPatch], None]:
        MUTANTS[name] = Mutant(name, doc, kind, fn)
        return fn
    return register


@mutant("takedraft", "accept every child whose target probability is > 0 (no acceptance draw)")
def _takedraft(mp: pytest.MonkeyPatch) -> None:
    # The rule accepts a child when u * sum(r) <= r(child); with the node uniforms at 0 that holds for
    # every child with r(child) > 0. Both sampling walks (host lists for small CPU batches, tensors
    # otherwise) get them so; the last uniform, the bonus draw, is left alone.
    def zero_node_uniforms(walk, uniforms_at: int):
        def walk_without_draws(*args):
            uniforms = args[uniforms_at].clone()  # [B, T+1]
            if uniforms.shape[1] > 2:
                HITS["takedraft"] += 1
            uniforms[:, :-1] = 0.0
            return walk(*args[:uniforms_at], uniforms, *args[uniforms_at + 1:])
        return walk_without_draws

    mp.setattr(verify, "_sampled_tree_host", zero_node_uniforms(verify._sampled_tree_host, 3))
    mp.setattr(verify, "_sampling_step", zero_node_uniforms(verify._sampling_step, 3))


@mutant("noresid", "draw the bonus token from p instead of the residual left by rejected children")
def _noresid(mp: pytest.MonkeyPatch) -> None:
    # The walks call target_probs (host walk, reference) or _probs_at (vectorised walk) at each visited
    # node, zero rejected tokens in that tensor, then sample the bonus from it: remember the
    # untouched p by storage address and sample from it instead.
    last: dict[int, torch.Tensor] = {}
    probs, probs_at, sample = verify.target_probs, verify._probs_at, verify.sample_from_probs

    def remember(p: torch.Tensor) -> torch.Tensor:
        last.clear()
        last[p.data_ptr()] = p.clone()
        return p

    def sample_from_p(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        p = last.get(weights.data_ptr())
        if p is not None and p.shape[-1] == weights.shape[-1]:
            p = p.reshape(weights.shape)
            if not torch.equal(p, weights):
                HITS["noresid"] += 1
            weights = p
        return sample(weights, u)

    mp.setattr(verify, "target_probs", lambda logits, cfg: remember(probs(logits, cfg)))
    mp.setattr(verify, "_probs_at", lambda logits, cur, configs: remember(probs_at(logits, cur, configs)))
    mp.setattr(verify, "sample_from_probs", sample_from_p)


def _patch_config(mp: pytest.MonkeyPatch, name: str, change: Callable) -> None:
    """Verify under `change(cfg)` (None: unchanged) instead of the request's SamplingConfig."""
    original = verify.target_probs

    def probs(logits, cfg):
        changed = change(cfg)
        if changed is not None and changed != cfg:
            HITS[name] += 1
            cfg = changed
        return original(logits, cfg)

    mp.setattr(verify, "target_probs", probs)


@mutant("T2", "apply the temperature twice (logits / T^2)")
def _temperature_twice(mp: pytest.MonkeyPatch) -> None:
    _patch_config(mp, "T2", lambda c: None if c.greedy else dataclasses.replace(c, temperature=c.temperature ** 2))


@mutant("nop", "ignore top_p")
def _no_top_p(mp: pytest.MonkeyPatch) -> None:
    _patch_config(mp, "nop", lambda c: dataclasses.replace(c, top_p=1.0))


@mutant("seeded-restart", "seeded requests' numbers restart at each step: keyed by depth in the step, not output position")
def _seeded_restart(mp: pytest.MonkeyPatch) -> None:
    # The position-keyed rule takes a depth-d node's uniform at output position start + d; with every
    # start at 0 a step reuses the numbers of the request's first tokens (the numbers then follow the
    # tree's consumption, as a generator stream did: both the law and the seed's text change).
    original = PositionKeys.uniforms

    def restarted(self: PositionKeys, max_depth: int) -> torch.Tensor:
        if any(self.starts):
            HITS["seeded-restart"] += 1
        return original(dataclasses.replace(self, starts=(0,) * len(self.starts)), max_depth)

    mp.setattr(PositionKeys, "uniforms", restarted)


@mutant("greedy-nonargmax", "greedy accepts the first child in the target's top 2, not only the argmax", "greedy")
def _greedy_runner_up(mp: pytest.MonkeyPatch) -> None:
    # Both greedy tree walks (host lists on the CPU, tensors elsewhere) accept the child equal to the
    # argmax at its parent: raise the first top-2 child's logit above the maximum, at a copy.
    def promoted(layout, target_logits: torch.Tensor) -> torch.Tensor:
        logits = target_logits.clone()  # [B, T, V]
        B, T = layout.token_ids.shape
        parents, tokens, valid = layout.parent_pos.tolist(), layout.token_ids.tolist(), layout.valid.tolist()
        top2 = logits.topk(2, dim=-1).indices.tolist()  # [B, T, 2]
        for b in range(B):
            done: set[int] = set()
            for j in range(1, T):  # children follow their parent, siblings in layout order
                q = parents[b][j]
                if valid[b][j] and q >= 0 and q not in done and tokens[b][j] in top2[b][q]:
                    done.add(q)
                    if tokens[b][j] != top2[b][q][0]:
                        HITS["greedy-nonargmax"] += 1
                        logits[b, q, tokens[b][j]] = logits[b, q].max() + 1.0
        return logits

    for name in ("_greedy_tree_host", "_greedy_tree"):
        original = getattr(verify, name)
        mp.setattr(verify, name, lambda layout, logits, _f=original: _f(layout, promoted(layout, logits)))
