"""Invariant 2 helpers: the target's exact law of the first sampled tokens (by enumeration, with
temperature, top-k, min-p and top-p applied by a rule written here from their definitions, not
imported from core/sampling.py), seeded draws through a speculating engine that count the draft
tokens it accepted, and Pearson's chi-square with its limit from scipy at a stated level."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

# Chi-square tests reject at this level: with fixed seeds a test is deterministic, and a correct
# sampler fails one such test in 1000 seed choices.
LEVEL = 1e-3
# A filter threshold this close to a probability would make the float32 engine and this float64
# reference disagree on whether a token survives: such a setting is refused, not tested.
BOUNDARY = 1e-4


def reference_law(logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0) -> np.ndarray:
    """[V] float64 probabilities of the next token, from the definitions: divide the logits by the
    temperature; keep the top_k largest (ties with the k-th kept); softmax; drop tokens less likely
    than min_p times the most likely one; keep the most likely tokens until their mass reaches top_p
    (a token is kept when the mass of the more likely ones is still below top_p); renormalise."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    keep = np.ones(z.shape, dtype=bool)
    if 0 < top_k < z.size:
        kth = np.sort(z)[-top_k]
        keep = z >= kth
    w = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    p = w / w.sum()
    if min_p > 0:
        bar = min_p * p.max()
        _check_away(p, bar, "min_p")
        p = np.where(p >= bar, p, 0.0)
        p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # mass of the more likely tokens
        _check_away(before[p[order] > 0], top_p, "top_p")
        p[order[before >= top_p]] = 0.0
        p /= p.sum()
    return p


def _check_away(values: np.ndarray, bar: float, name: str) -> None:
    if np.any(np.abs(values - bar) < BOUNDARY):
        raise ValueError(f"{name} lies within {BOUNDARY} of a token's mass here: pick another setting")


@functools.lru_cache(maxsize=4)
def _hf(target_dir: str):
    import transformers  # here, so that the core tests can use reference_law without it

    return transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@torch.no_grad()
def exact_first_tokens(target_dir, prompt: list[int], length: int, *, temperature: float = 1.0, top_k: int = 0,
                       top_p: float = 1.0, min_p: float = 0.0, adjust=None,
                       stop: tuple[int, ...] = ()) -> dict[tuple[int, ...], float]:
    """P(first `length` sampled tokens) under transformers' forward of the target and `reference_law`,
    for every sequence of nonzero probability; `adjust(logits, output so far)` changes the logits first
    (penalties, grammar masks); a sequence ends early at a token of `stop`, as the engine's output does."""
    hf = _hf(str(target_dir))

    def law(ids: list[int]) -> np.ndarray:
        logits = hf(torch.tensor([ids])).logits[0, -1].double()
        if adjust is not None:
            logits = adjust(logits, ids[len(prompt):]).double()
        return reference_law(logits.numpy(), temperature, top_k, top_p, min_p)

    out: dict[tuple[int, ...], float] = {}

    def expand(prefix: list[int], p: float) -> None:
        if len(prefix) == length or (prefix and prefix[-1] in stop):
            out[tuple(prefix)] = p
            return
        q = law(prompt + prefix)
        for t in np.flatnonzero(q):
            expand(prefix + [int(t)], p * float(q[t]))

    expand([], 1.0)
    return out


@dataclass(frozen=True)
class Draws:
    """Seeded generations of one prompt: how often each output appeared, and what the engine speculated."""

    counts: dict[tuple[int, ...], int]
    trials: int
    accepted: int  # draft tokens accepted, summed over the trials
    verified: int  # draft tokens verified


def draw(llm, prompt: list[int], params, trials: int, batch_size: int = 1, engine_kwargs: dict | None = None,
         seeded: bool = False) -> Draws:
    """`trials` generations (`params(seed)` -> SamplingParams): one at a time through `llm.generate`, or
    `batch_size` at a time through the batched engine. Unseeded (default), requests take the sequential
    rejection rule with torch's global generator, reset to the chunk's first trial number before each
    chunk (deterministic); seeded (seeds 0..trials-1), they take the position-keyed seeded sampler."""
    from trtllm_moespec.engine.batch import BatchedEngine

    counts: dict[tuple[int, ...], int] = {}
    accepted = verified = 0
    for start in range(0, trials, batch_size):
        seeds = [s if seeded else None for s in range(start, min(start + batch_size, trials))]
        if not seeded:
            torch.manual_seed(start)
        if batch_size == 1:
            outs = [(o.token_ids, o.steps) for s in seeds for o in llm.generate([prompt], params(s))]
        else:
            requests = [llm.make_request(prompt, params(s)) for s in seeds]
            BatchedEngine(llm.engine, max_batch_size=batch_size, **(engine_kwargs or {})).run_all(requests)
            outs = [(r.output_ids, r.steps) for r in requests]
        for ids, steps in outs:
            counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
            accepted += sum(s.accepted_tokens for s in steps)
            verified += sum(s.verified_tokens for s in steps)
    return Draws(counts, trials, accepted, verified)


def chi_square(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float], trials: int) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the cells of `exact`; cells expecting < 5 draws are merged
    into one, as the test needs."""
    cells = sorted(exact)
    observed = np.array([counts.get(c, 0) for c in cells], dtype=float)
    expected = np.array([exact[c] for c in cells]) * trials
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def chi_square_limit(dof: int, level: float = LEVEL) -> float:
    """The chi-square quantile that a statistic with `dof` degrees of freedom exceeds with probability `level`."""
    return float(stats.chi2.ppf(1.0 - level, dof))


def assert_follows(draws: Draws, exact: dict[tuple[int, ...], float]) -> float:
    """Every draw has nonzero probability and the counts pass the chi-square test; returns the statistic."""
    for key in draws.counts:
        assert key in exact, f"emitted {key}, which has zero probability under the target"
    stat, dof = chi_square(draws.counts, exact, draws.trials)
    limit = chi_square_limit(dof)
    # (shown with -s or -rP: the numbers the tests' thresholds were set from)
    print(f"accepted {draws.accepted} drafts in {draws.trials} trials ({draws.verified} verified); "
          f"chi-square {stat:.1f} with {dof} degrees of freedom, limit {limit:.1f}")
    assert dof >= 1, (dof, exact)
    assert stat < limit, (stat, dof, limit, draws.counts, exact)
    return stat
