"""Invariant 2 helpers: the target's exact distribution of the first sampled tokens (top-k,
temperature 1, by enumeration) and Pearson's chi-square of observed draws against it."""

from __future__ import annotations

import numpy as np
import torch
import transformers


@torch.no_grad()
def exact_first_tokens(target_dir, prompt: list[int], top_k: int, length: int,
                       adjust=None, min_p: float = 0.0) -> dict[tuple[int, ...], float]:
    """P(first `length` sampled tokens) under the transformers target, for every sequence of nonzero
    probability (top-k filtering at temperature 1, then min_p); `adjust(logits, output so far)` changes
    the logits first (penalties)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir))

    def probs(ids: list[int]) -> torch.Tensor:
        logits = hf(torch.tensor([ids])).logits[0, -1].double()
        if adjust is not None:
            logits = adjust(logits, ids[len(prompt):]).double()
        kth = logits.topk(top_k).values[-1]
        p = torch.where(logits >= kth, logits, -torch.inf).softmax(-1)
        p = torch.where(p >= min_p * p.max(), p, 0.0)
        return p / p.sum()

    out: dict[tuple[int, ...], float] = {}

    def expand(prefix: list[int], p: torch.Tensor) -> None:
        if len(prefix) == length:
            out[tuple(prefix)] = float(p)
            return
        q = probs(prompt + prefix)
        for t in q.nonzero().flatten().tolist():
            expand(prefix + [t], p * q[t])

    expand([], torch.tensor(1.0, dtype=torch.float64))
    return out


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


def chi_square_limit(dof: int, z: float = 3.09) -> float:
    """The chi-square quantile at the normal quantile z (3.09: 99.9%) for `dof` degrees of freedom, by
    Wilson and Hilferty's cube-root approximation, within 2% above the exact one (26.3 for 8 degrees of
    freedom, exactly 26.1)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * a ** 0.5) ** 3
