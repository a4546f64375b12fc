"""`moespec profile`: measure C(k) and fit C(k, U) on this device, write cost_profile.json.

    moespec profile --model moespec-tiny [--tree 4,8,32] [--repeats 20] [--out PATH]

C(k), k = 0..K (K = the tree's max_draft_tokens), is the median wall time of a whole
speculative iteration (draft, select, verify, commit) through the real engine, with
the selection forced to the top-k draft nodes; k values are interleaved across
rounds, plain steps (no drafting) among them. The same timed steps give (k, U,
seconds) samples, U = unique (layer, expert) pairs the verify forward woke (root
included), for ExpertCostModel.fit. One drafter forward is timed apart, and so is
what joint's expert term costs a step (`expert_overhead`: its predictor and greedy
selection against EVICT's, side by side on the same prompts), which with the fit's
within-k slope decides whether joint keeps that term (core/cost.py `expert_term_pays`). Samples
outside the Tukey fences of their k are dropped before the medians (load spikes).
The stored C(k) is the pool-adjacent-violators (non-decreasing) fit of the medians;
the raw medians, spreads (IQR), mean U, all samples and the load average are kept.

Noise is checked against what the profile must rank: when the typical standard error
of a C(k) exceeds a quarter of C(K) - C(0) (or of C(0) - plain step) the profile is
refused (exit 2, nothing written; `--allow-noisy` writes it anyway, labelled); above
a tenth it is written with a loud warning.

The output path is checked before anything is measured (a folder this process cannot create
files in is refused, exit 2); if the final write fails anyway (a full disk), the profile goes to
the temporary directory, or to stdout, and stderr says where (exit 1).

Without `--out` the profile goes beside the model, except for models shipped inside
the package (moespec-tiny): their assets are never written by a default; the profile
then goes to ./<model>.cost_profile.json (use it with --cost-profile, or pass --out
explicitly to replace the shipped one).

Expert parallelism: `mpirun -n N moespec profile --ep N ...` profiles the N-rank engine
and fits C(k, U_max), U_max = each MoE layer's busiest rank summed over layers
(core/placement.py), the U that EP-aware joint / ecospec price.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..assets import DEFAULT_MODEL
from ..core.cost import CostTable, ExpertCostModel, expert_term_pays
from ..outfiles import check_writable, save_report
from .measure import (PLAIN, CostCurve, ForcedBudget, ForcedGuard, NoiseReport, StepDriver, StepSample, assess_noise,
                      monotone, run_interleaved, summarize, time_draft_forward, trim_outliers, trim_values)

__all__ = ["ProfileResult", "main", "profile_model"]


@dataclass(frozen=True)
class ProfileResult:
    table: CostTable
    curve: CostCurve
    samples: list[StepSample]
    path: Path | None  # where the profile was written (None: stdout, when no file could be written)
    noise: NoiseReport | None = None
    requested: Path | None = None  # where it was asked to go (differs from `path` when that write failed)


def default_prompts(num: int = 3) -> list[str]:
    """One prompt from each bundled benchmark dataset, cycled to `num`."""
    from ..bench.datasets import DATASETS, load_prompts

    texts = [load_prompts(d, 1)[0].text for d in DATASETS]
    return [texts[i % len(texts)] for i in range(num)]


def profile_model(model: str = DEFAULT_MODEL, draft_model: str | None = None, tree=None, device: str = "cpu",
                  dtype: str = "float32", repeats: int = 40, warmup_rounds: int = 2, prompts: list[str] | None = None,
                  out: str | Path | None = None, seed: int = 0, show_progress: bool = True,
                  allow_noisy: bool = False, ep=None) -> ProfileResult:
    """Measure, fit and save a cost profile (returns what was written; ValueError if too noisy)."""
    import torch
    from tqdm.auto import tqdm

    from ..api import LLM, SamplingParams
    from ..resolve import device_name
    from ..bench.datasets import encode_prompt

    if repeats < 3:
        raise ValueError(f"--repeats must be >= 3 for a median and a spread, got {repeats}")
    from ..resolve import default_tree, resolve_model

    paths = resolve_model(model, draft_model)
    tree = tree or default_tree(None, paths)  # re-profiling keeps the model's tree
    path = output_path(paths.cost_profile, out)
    check_writable(path, "--out" if out is not None else "the cost profile path")  # before minutes of measuring
    llm = LLM(model=model, draft_model=draft_model, policy="eagle3", tree=tree, device=device, dtype=dtype,
              policy_options={"budget": tree.max_draft_tokens}, threads=None, ep=ep)  # --threads already applied
    max_k = tree.max_draft_tokens
    limit = llm.target.max_position_embeddings
    gen_tokens = min(512, limit // 2)
    ids = [encode_prompt(p, llm.tokenizer, llm.target.vocab_size, limit - gen_tokens - 1)
           for p in (prompts or default_prompts())]
    policy = ForcedBudget(max_k)
    llm.engine.policy = policy  # the engine's step path, with the selection forced to top-k
    llm.engine.guard = ForcedGuard(policy)  # ... and plain steps (k = PLAIN) through its speculate-or-not path
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    driver = StepDriver(llm.engine, lambda p: llm.make_request(p, params), ids, min_remaining=tree.steps + 2)
    ks = [PLAIN] + list(range(max_k + 1))
    total = (repeats + warmup_rounds) * len(ks)
    load_before = os.getloadavg()
    with tqdm(total=total, desc=f"profile C(k), k=0..{max_k} and a plain step", disable=not show_progress) as bar:
        samples = run_interleaved(driver, policy, ks, repeats, warmup_rounds, len(llm.target.moe_layers), seed, bar)
    draft_forward = _draft_forward(llm, ids, tree, repeats)
    load_after = os.getloadavg()
    plain = trim_values(s.seconds for s in samples if s.verified_tokens == PLAIN)
    plain_s = float(np.median(plain))
    samples = [s for s in samples if s.verified_tokens != PLAIN]
    curve = summarize(samples, max_k)
    expert_model, fit_on = fit_expert_model(samples)
    method = (f"engine step (draft+select+verify+commit), top-k forced, k=0..{max_k} interleaved in random order; "
              f"median of {repeats} rounds after {warmup_rounds} warm-up rounds, non-decreasing (PAV) fit of the "
              f"medians; spread = IQR; {len(ids)} prompts, greedy; C(k, U) least squares over {len(fit_on)} of "
              f"{len(samples)} steps (Tukey-fence outliers per k dropped); plain step = median of {len(plain)} "
              f"interleaved plain steps; drafter forward = median of {repeats} (steps - 1 step drafts) / "
              f"(steps - 1); torch threads {torch.get_num_threads()}"
              + (f"; expert parallel over {ep.group.world_size} ranks, U = U_max (busiest rank per layer)" if ep else ""))
    costs = monotone(curve.median_s)
    noise = assess_noise(curve, costs, plain_s)
    if noise.verdict == "unusable" and not allow_noisy:
        raise ValueError(f"profile refused, nothing written: {noise.message()}; the machine is too busy "
                         f"(load average {load_after[0]:.1f}): rerun when it is quieter, with more --repeats, or "
                         "pass --allow-noisy")
    if noise.verdict != "ok":
        method += f"; WARNING {noise.message()}"
    table = CostTable(costs, model_id=llm.paths.model_id, device=device_name(llm.device),
                      dtype=dtype, tree=tree.as_tuple(), method=method, date=dt.datetime.now().isoformat(timespec="seconds"),
                      spread=tuple(0.0 if np.isnan(x) else x for x in curve.iqr_s), expert_model=expert_model,
                      plain_step=plain_s, draft_forward=draft_forward,
                      load_average=tuple(round(x, 2) for x in load_before + load_after))
    # (one process only: the two engines it builds share this process's target, not the ranks' shards)
    overhead = measure_expert_overhead(llm, table, ids) if ep is None else None
    if overhead is not None:
        table = replace(table, expert_overhead=overhead, method=table.method + (
            "; expert overhead = median joint (predictor + select) - median evict select over interleaved "
            "guard-off greedy steps"))
    written = save_profile(table, curve, samples, path, noise)
    return ProfileResult(table, curve, samples, written, noise, requested=path)


def fit_expert_model(samples: list[StepSample]) -> tuple[ExpertCostModel, list[StepSample]]:
    """C(k, U) fitted on the speculative samples inside their k's Tukey fence; (the fit, the samples used)."""
    fit_on = trim_outliers(samples)
    model = ExpertCostModel.fit(np.array([s.verified_tokens for s in fit_on]),
                                np.array([s.unique_experts for s in fit_on]), np.array([s.seconds for s in fit_on]))
    return model, fit_on


def _draft_forward(llm, ids: list[list[int]], tree, repeats: int) -> float | None:
    """One drafter forward (seconds) on live drafter caches of the profiling prompts; None without EAGLE-3."""
    import torch

    from ..engine.drafters import Eagle3Source

    source = llm.engine.draft_source
    if not isinstance(source, Eagle3Source) or tree.steps < 2:
        return None
    caches = []
    for p in ids:
        prompt = torch.tensor([p], dtype=torch.int64, device=llm.target.device)
        prefill = llm.target.prefill(llm.target.new_cache(), prompt)
        root = int(prefill.logits[0, -1].argmax())
        caches.append(source.start(prompt, prefill, root).cache)
    median, _ = time_draft_forward(source.drafter, caches, tree.steps, tree.topk, repeats)
    return max(median, 1e-7)


def measure_expert_overhead(llm, table: CostTable, ids: list[list[int]], tokens: int = 48) -> float | None:
    """Seconds per speculative step that joint's expert term adds: median (predictor + selection) of
    joint with the term forced on, minus median selection of evict, both on `llm`'s target and `table`,
    guard off, greedy, prompts alternated between the two. None when the model has no expert predictor
    for joint (nothing to decide then)."""
    from ..api import LLM, SamplingParams

    common = dict(model=llm.config.runtime.model, draft_model=llm.config.spec.draft_model, tree=llm.tree,
                  device=str(llm.device), dtype=llm.dtype, cost_profile=table, guard="off", threads=None,
                  target_model=llm.target)
    try:
        joint = LLM(policy="joint", policy_options={"expert_term": True}, **common)
    except (ValueError, FileNotFoundError):
        return None
    evict = LLM(policy="evict", **common)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    spent: dict[str, list[float]] = {"joint": [], "evict": []}
    for p in ids:
        for name, engine in (("joint", joint), ("evict", evict)):
            out = engine.generate([p], params, max_batch_size=1)[0]
            spent[name] += [s.predictor_ms + s.select_ms for s in out.steps if s.speculated]
    if not spent["joint"] or not spent["evict"]:
        return None
    return max(float(np.median(spent["joint"]) - np.median(spent["evict"])), 0.0) / 1e3


def output_path(model_profile: Path, out: str | Path | None) -> Path:
    """Where the profile goes: --out, else beside the model unless the model ships inside the package."""
    from ..assets import ASSETS_DIR

    if out is not None:
        path = Path(out)
        if path.is_dir():
            raise ValueError(f"--out {path} is a directory; give a file path such as {path / 'cost_profile.json'}")
        return path
    if model_profile.resolve().is_relative_to(ASSETS_DIR):
        return Path.cwd() / f"{model_profile.parent.name}.cost_profile.json"  # shipped assets are never written by a default
    return model_profile


def save_profile(table: CostTable, curve: CostCurve, samples: list[StepSample], path: Path,
                 noise: NoiseReport | None = None) -> Path | None:
    """CostTable JSON plus the raw measurements (extra keys CostTable.load ignores); atomic write, to a
    fallback when that fails (outfiles.save_report). Returns where it went (None: stdout)."""
    data = table.to_json()
    data["measured"] = {
        "median_s": list(curve.median_s), "iqr_s": [None if np.isnan(x) else x for x in curve.iqr_s],
        "mean_unique_experts": [None if np.isnan(x) else x for x in curve.mean_unique], "count": list(curve.count),
        "samples": {"k": [s.verified_tokens for s in samples], "unique_experts": [s.unique_experts for s in samples],
                    "seconds": [round(s.seconds, 7) for s in samples]},
    }
    if noise is not None:
        data["noise"] = {"median_se_s": noise.median_se_s, "span_s": noise.span_s, "plain_gap_s": noise.plain_gap_s,
                         "ratio": noise.ratio, "verdict": noise.verdict}
    if path.is_dir():
        raise ValueError(f"{path} is a directory; give a file path")
    return save_report(path, json.dumps(data, indent=1) + "\n", "--out", "moespec profile")


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
        if t.expert_overhead is not None:
            lines.append("joint: " + expert_term_pays(t)[1])
    if t.plain_step is not None:
        lines.append(f"plain step {t.plain_step * 1e3:.2f} ms")
    if t.draft_forward is not None:
        lines.append(f"one drafter forward {t.draft_forward * 1e3:.2f} ms")
    if t.load_average is not None:
        lines.append(f"load average {t.load_average[0]:.2f} before, {t.load_average[3]:.2f} after")
    if result.noise is not None:
        lines.append(("" if result.noise.verdict == "ok" else "WARNING: ") + result.noise.message())
    lines.append(f"wrote {result.path}" if result.path is not None else "wrote the profile to stdout (above)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moespec profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"local HF directory or an embedded model (default {DEFAULT_MODEL})")
    p.add_argument("--draft-model", default=None, help="EAGLE-3 drafter directory (default: the model's own)")
    p.add_argument("--tree", default=None, help="steps,topk,max_draft_tokens (default: the model's, the tree of "
                   "its shipped profile; 4,8,32 without one)")
    p.add_argument("--out", default=None, help="output file (default: cost_profile.json beside the model; for the "
                   "shipped models ./moespec-<family>.cost_profile.json, never the shipped asset)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=40, help="timed rounds over all k (default 40)")
    p.add_argument("--allow-noisy", action="store_true", help="write a profile whose noise exceeds a quarter of "
                   "the differences it must rank (labelled in the file) instead of refusing")
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
        tree = TreeConfig.parse(args.tree) if args.tree is not None else None
        result = profile_model(args.model, args.draft_model, tree, args.device, args.dtype,
                               args.repeats, args.warmup, args.prompts, args.out, args.seed,
                               allow_noisy=args.allow_noisy, ep=ep)
        print(format_table(result))
        if result.noise is not None and result.noise.verdict != "ok":
            print(f"moespec profile: WARNING: {result.noise.message()}", file=sys.stderr)
        return 0 if result.path == result.requested else 1  # 1: written elsewhere (stderr said where)

    try:
        set_threads(args.threads)
        from ..parallel.run import launch_ep_size, run_expert_parallel

        if launch_ep_size(args.ep, args.model) > 1:
            return run_expert_parallel(args.device, max(args.threads, 1), run)
        return run()
    except (ValueError, FileNotFoundError) as e:
        from ..cli import flag_message

        print(f"moespec profile: error: {flag_message(str(e), build_parser())}", file=sys.stderr)
        return 2
