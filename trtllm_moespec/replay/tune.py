"""Choose a policy option offline, the way the EcoSpec paper chose its verification budget: score each
candidate value on recorded steps and keep the one with the best mean speedup over the data sets.

Speedup here is replay's: tokens per second of priced step cost (`score.StepCost`) times the profiled
plain step, i.e. against one token per plain step. It prices no drafting differences between candidates
(they share the tree) and no goodput guard; on the chosen model the live bench then measures the result.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

from ..core.policies import SelectionPolicy
from .records import ReplayFile
from .score import StepCost, replay_policy


@dataclass(frozen=True)
class GridPoint:
    value: Any  # the option's candidate value
    speedup: dict[str, float]  # per "file:dataset" group: replayed tokens/s x the plain step
    tokens_per_step: float  # over every group's steps
    verified_per_step: float

    @property
    def mean_speedup(self) -> float:
        return sum(self.speedup.values()) / len(self.speedup)

    def as_dict(self) -> dict:
        return {"value": self.value, "mean_speedup": round(self.mean_speedup, 4),
                "speedup": {k: round(v, 4) for k, v in self.speedup.items()},
                "tokens_per_step": round(self.tokens_per_step, 4), "verified_per_step": round(self.verified_per_step, 3)}


def dataset_steps(records: ReplayFile) -> dict[str, list[int]]:
    """Step indices of each data set of the records (whole requests: online values stay per request)."""
    prompts = records.meta.get("prompts") or []
    groups: dict[str, list[int]] = defaultdict(list)
    for s in range(records.num_steps):
        r = records.step(s).request
        groups[prompts[r].split(":")[0] if r < len(prompts) else "all"].append(s)
    return dict(groups)


def score_grid(files: dict[str, tuple[ReplayFile, Any]], build: Callable[[Any], SelectionPolicy], grid: tuple,
               cost: StepCost, max_nodes: int) -> list[GridPoint]:
    """Replay `build(value)` for every value of `grid` on each file's data sets.

    files: label -> (records, value model); the mean is over every (file, data set) group."""
    plain = cost.table.plain_step
    if plain is None:
        raise ValueError("tuning needs a cost profile with a plain-step cost (re-profile with `moespec profile`)")
    points = []
    for value in grid:
        policy, speedup, tokens, verified, steps = build(value), {}, 0.0, 0, 0
        for label, (records, values) in files.items():
            for dataset, idx in dataset_steps(records).items():
                tally, _ = replay_policy(records, dataset, policy, values, cost, max_nodes, steps=idx)
                speedup[f"{label}:{dataset}"] = tally.tokens / tally.cost_s * plain
                tokens, verified, steps = tokens + tally.tokens, verified + tally.verified, steps + tally.steps
        points.append(GridPoint(value, speedup, tokens / steps, verified / steps))
    return points


def best_point(points: list[GridPoint]) -> GridPoint:
    """The best mean speedup; ties go to the earlier (smaller) candidate."""
    return max(points, key=lambda p: (p.mean_speedup, -points.index(p)))
