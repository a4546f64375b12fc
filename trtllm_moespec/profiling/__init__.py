"""`moespec profile`: measure C(k) and fit C(k, U) on this device, write cost_profile.json.

    moespec profile --model moespec-tiny [--tree 4,8,32] [--repeats 20] [--out PATH]

C(k), k = 0..K (K = the tree's max_draft_tokens), is the median wall time of a whole
speculative iteration (draft, select, verify, commit) through the real engine, with
the selection forced to the top-k draft nodes; k values are interleaved across
rounds. The same timed steps give (k, U, seconds) samples, U = unique (layer,
expert) pairs the verify forward woke (root included), for ExpertCostModel.fit.
The stored C(k) is the pool-adjacent-violators (non-decreasing) fit of the
medians; the raw medians, spreads (IQR), mean U and all samples are kept beside it.

Expert parallelism: `mpirun -n N moespec profile --ep N ...` profiles the N-rank engine
and fits C(k, U_max), U_max = each MoE layer's busiest rank summed over layers
(core/placement.py), the U that EP-aware joint / ecospec price.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.cost import CostTable, ExpertCostModel
from .measure import (CostCurve, ForcedBudget, StepDriver, StepSample, monotone, run_interleaved, summarize,
                      trim_outliers)

__all__ = ["ProfileResult", "main", "profile_model"]


@dataclass(frozen=True)
class ProfileResult:
    table: CostTable
    curve: CostCurve
    samples: list[StepSample]
    path: Path | None


def default_prompts(num: int = 3) -> list[str]:
    """One prompt from each bundled benchmark dataset, cycled to `num`."""
    from ..bench.datasets import DATASETS, load_prompts

    texts = [load_prompts(d, 1)[0].text for d in DATASETS]
    return [texts[i % len(texts)] for i in range(num)]


def profile_model(model: str = "moespec-tiny", draft_model: str | None = None, tree=None, device: str = "cpu",
                  dtype: str = "float32", repeats: int = 20, warmup_rounds: int = 2, prompts: list[str] | None = None,
                  out: str | Path | None = None, seed: int = 0, show_progress: bool = True, ep=None) -> ProfileResult:
    """Measure, fit and save a cost profile (returns what was written)."""
    import torch
    from tqdm.auto import tqdm

    from ..api import LLM, SamplingParams
    from ..engine.config import TreeConfig
    from ..resolve import device_name
    from ..bench.datasets import encode_prompt

    tree = tree or TreeConfig()
    if repeats < 3:
        raise ValueError(f"--repeats must be >= 3 for a median and a spread, got {repeats}")
    llm = LLM(model=model, draft_model=draft_model, policy="eagle3", tree=tree, device=device, dtype=dtype,
              policy_options={"budget": tree.max_draft_tokens}, threads=None, ep=ep)  # --threads already applied
    max_k = tree.max_draft_tokens
    limit = llm.target.max_position_embeddings
    gen_tokens = min(512, limit // 2)
    ids = [encode_prompt(p, llm.tokenizer, llm.target.vocab_size, limit - gen_tokens - 1)
           for p in (prompts or default_prompts())]
    policy = ForcedBudget(max_k)
    llm.engine.policy = policy  # the engine's step path, with the selection forced to top-k
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    driver = StepDriver(llm.engine, lambda p: llm.make_request(p, params), ids, min_remaining=tree.steps + 2)
    ks = list(range(max_k + 1))
    total = (repeats + warmup_rounds) * len(ks)
    with tqdm(total=total, desc=f"profile C(k), k=0..{max_k}", disable=not show_progress) as bar:
        samples = run_interleaved(driver, policy, ks, repeats, warmup_rounds, len(llm.target.moe_layers), seed, bar)
    curve = summarize(samples, max_k)
    fit_on = trim_outliers(samples)
    expert_model = ExpertCostModel.fit(np.array([s.verified_tokens for s in fit_on]),
                                       np.array([s.unique_experts for s in fit_on]),
                                       np.array([s.seconds for s in fit_on]))
    method = (f"engine step (draft+select+verify+commit), top-k forced, k=0..{max_k} interleaved in random order; "
              f"median of {repeats} rounds after {warmup_rounds} warm-up rounds, non-decreasing (PAV) fit of the "
              f"medians; spread = IQR; {len(ids)} prompts, greedy; C(k, U) least squares over {len(fit_on)} of "
              f"{len(samples)} steps (Tukey-fence outliers per k dropped); "
              f"torch threads {torch.get_num_threads()}"
              + (f"; expert parallel over {ep.group.world_size} ranks, U = U_max (busiest rank per layer)" if ep else ""))
    table = CostTable(monotone(curve.median_s), model_id=llm.paths.model_id, device=device_name(llm.device),
                      dtype=dtype, tree=tree.as_tuple(), method=method, date=dt.datetime.now().isoformat(timespec="seconds"),
                      spread=tuple(0.0 if np.isnan(x) else x for x in curve.iqr_s), expert_model=expert_model)
    path = Path(out) if out is not None else llm.paths.cost_profile
    save_profile(table, curve, samples, path)
    return ProfileResult(table, curve, samples, path)


def save_profile(table: CostTable, curve: CostCurve, samples: list[StepSample], path: Path) -> Path:
    """CostTable JSON plus the raw measurements (extra keys CostTable.load ignores); atomic write."""
    data = table.to_json()
    data["measured"] = {
        "median_s": list(curve.median_s), "iqr_s": [None if np.isnan(x) else x for x in curve.iqr_s],
        "mean_unique_experts": [None if np.isnan(x) else x for x in curve.mean_unique], "count": list(curve.count),
        "samples": {"k": [s.verified_tokens for s in samples], "unique_experts": [s.unique_experts for s in samples],
                    "seconds": [round(s.seconds, 7) for s in samples]},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return path


def format_table(result: ProfileResult) -> str:
    t, c = result.table, result.curve
    lines = [f"cost profile for {t.model_id} on {t.device} ({t.dtype}, tree {t.tree})",
             f"{'k':>3} {'C(k) ms':>9} {'median ms':>10} {'IQR ms':>8} {'mean U':>7} {'n':>4}"]
    for k, cost in enumerate(t.costs):
        iqr = c.iqr_s[k]
        lines.append(f"{k:>3} {cost * 1e3:>9.2f} {c.median_s[k] * 1e3:>10.2f} "
                     f"{'-' if np.isnan(iqr) else f'{iqr * 1e3:.2f}':>8} "
                     f"{'-' if np.isnan(c.mean_unique[k]) else f'{c.mean_unique[k]:.1f}':>7} {c.count[k]:>4}")
    m = t.expert_model
    if m is not None:
        lines.append(f"C(k, U) = {m.c0 * 1e3:.3f} ms + {m.c_tok * 1e3:.4f} ms * k + {m.c_exp * 1e3:.4f} ms * U "
                     f"(rms residual {m.residual_rms * 1e3:.3f} ms, {m.num_samples} steps)")
    lines.append(f"wrote {result.path}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moespec profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="moespec-tiny", help="local HF directory or 'moespec-tiny'")
    p.add_argument("--draft-model", default=None, help="EAGLE-3 drafter directory (default: the model's own)")
    p.add_argument("--tree", default="4,8,32", help="steps,topk,max_draft_tokens (default 4,8,32)")
    p.add_argument("--out", default=None, help="output path (default: cost_profile.json beside the model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=20, help="timed rounds over all k (default 20)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up rounds (default 2)")
    p.add_argument("--prompts", nargs="+", default=None, help="prompt texts (default: one per bundled dataset)")
    p.add_argument("--seed", type=int, default=0, help="seed of the k interleaving order")
    p.add_argument("--ep", type=int, default=None, help="expert parallelism: `mpirun -n N moespec profile --ep N` "
                   "fits C(k, U_max)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: on a shared CPU more "
                   "threads stall in OpenMP barriers; 0 = torch's default). Bench with the same setting.")
    return p


def set_threads(threads: int) -> int:
    """Apply --threads (0 keeps torch's default); returns the thread count in effect."""
    import torch

    if threads < 0:
        raise ValueError(f"--threads must be >= 0, got {threads}")
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def main(argv: list[str] | None = None) -> int:
    from ..engine.config import TreeConfig

    args = build_parser().parse_args(argv)

    def run(ep=None) -> int:
        result = profile_model(args.model, args.draft_model, TreeConfig.parse(args.tree), args.device, args.dtype,
                               args.repeats, args.warmup, args.prompts, args.out, args.seed, ep=ep)
        print(format_table(result))
        return 0

    try:
        set_threads(args.threads)
        from ..parallel.run import launch_ep_size, run_expert_parallel

        if launch_ep_size(args.ep, args.model) > 1:
            return run_expert_parallel(args.device, max(args.threads, 1), run)
        return run()
    except (ValueError, FileNotFoundError) as e:
        print(f"moespec profile: error: {e}", file=sys.stderr)
        return 2
