"""Benchmark reports: the JSON document and the markdown tables (papers' Table 1 / Table 2 layout)."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path

import numpy as np

from ..engine.stats import GenerationStats
from ..outfiles import write_text_atomic
from .runner import BenchState

SCHEMA = "moespec-bench/1"
RESULT_KEYS = ("dataset", "method", "temperature", "analysis_only", "num_prompts", "num_tokens", "num_steps",
               "tokens_per_s", "speedup_vs_ar", "speedup_vs_eagle3", "mean_accepted_tokens", "verified_tokens",
               "unique_experts_per_layer", "draft_ms", "select_ms", "verify_ms", "predictor_ms", "commit_ms",
               "overhead_ms", "predictor_topk_acc", "plain_step_fraction", "decoding_stats")
DATASET_TITLES = {"humaneval": "HumanEval", "mt_bench": "MT-Bench", "gsm8k": "GSM8K"}


def machine_description(device: str = "cpu") -> dict:
    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": sys.version.split()[0], "cpu_count": os.cpu_count(), "usable_cores": cores,
            "torch": torch.__version__, "torch_num_threads": torch.get_num_threads(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None, "device": device}


def percentiles(values) -> dict:
    """trtllm-bench-style summary of a per-step quantity."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return {"average": None, "p50": None, "p90": None, "p99": None}
    return {"average": float(x.mean()), "p50": float(np.percentile(x, 50)), "p90": float(np.percentile(x, 90)),
            "p99": float(np.percentile(x, 99))}


def aggregate(state: BenchState, analysis_only: dict[str, bool]) -> list[dict]:
    """One row per (dataset, method, temperature), speedups against ar / eagle3 of the same cell."""
    merged = {key: GenerationStats.merge(v) for key, v in state.stats.items() if v}
    rows = []
    for (ds, method, temp), s in merged.items():
        ar, eagle = merged.get((ds, "ar", temp)), merged.get((ds, "eagle3", temp))
        ratio = lambda base: s.tokens_per_s / base.tokens_per_s if base and base.tokens_per_s > 0 else None  # noqa: E731
        rows.append({
            "dataset": ds, "method": method, "temperature": temp, "analysis_only": analysis_only.get(method, False),
            "num_prompts": len(state.stats[(ds, method, temp)]), "num_tokens": s.num_tokens, "num_steps": s.num_steps,
            "tokens_per_s": s.tokens_per_s, "speedup_vs_ar": ratio(ar), "speedup_vs_eagle3": ratio(eagle),
            "mean_accepted_tokens": s.mean_accepted_tokens, "verified_tokens": s.verified_tokens,
            "unique_experts_per_layer": s.unique_experts_per_layer, "draft_ms": s.draft_ms, "select_ms": s.select_ms,
            "verify_ms": s.verify_ms, "predictor_ms": s.predictor_ms, "commit_ms": s.commit_ms,
            "overhead_ms": s.overhead_ms, "predictor_topk_acc": s.predictor_topk_acc,
            "plain_step_fraction": _plain_fraction(state, (ds, method, temp)),
            "decoding_stats": {"acceptance_length": percentiles(s.acceptance_lengths),
                               "num_draft_tokens": percentiles(s.num_draft_tokens)},
        })
    return rows


def _plain_fraction(state: BenchState, key) -> float | None:
    """Share of steps the speculate-or-not rule decoded plainly (None for methods that never draft)."""
    flags = state.steps.get(key, {}).get("speculated", [])
    return float(1.0 - np.mean(flags)) if flags else None


def build_report(*, status: str, error: str | None, command: list[str], config: dict, machine_start: dict,
                 state: BenchState, analysis_only: dict[str, bool], started: float, ended: float,
                 cost_profile: dict | None) -> dict:
    machine = dict(machine_start)
    machine["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {
        "schema": SCHEMA, "status": status, "error": error,
        "command": shlex.join(command), "argv": command,
        "date": dt.datetime.fromtimestamp(started).isoformat(timespec="seconds"), "wall_s": round(ended - started, 2),
        "machine": machine, "config": config, "cost_profile": cost_profile,
        "completed_prompt_groups": state.completed_prompts,
        "prompt_tokens": {ds: v for ds, v in state.prompt_tokens.items()},
        "results": aggregate(state, analysis_only),
        "steps": [{"dataset": k[0], "method": k[1], "temperature": k[2], **cols} for k, cols in state.steps.items()],
    }


def write_json(report: dict, path: str | Path) -> Path:
    return write_text_atomic(path, json.dumps(report, indent=1) + "\n")


def partial_path(path: str | Path) -> Path:
    """Where an incomplete report goes when `path` already exists: NAME.partial.EXT beside it (an interrupted
    or aborted run must never replace a finished report with a worse one)."""
    path = Path(path)
    if not path.exists():
        return path
    return path.with_name(f"{path.stem}.partial{path.suffix}")


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _grid(rows: list[dict]):
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    temps = sorted(dict.fromkeys(r["temperature"] for r in rows))
    cell = {(r["dataset"], r["method"], r["temperature"]): r for r in rows}
    return datasets, methods, temps, cell


def markdown(report: dict) -> str:
    rows = report["results"]
    datasets, methods, temps, cell = _grid(rows)
    m = report["machine"]
    out = [f"# moespec bench ({report['status']})", "",
           f"`{report['command']}`", "",
           f"{m['platform']}, {m['usable_cores']} usable cores, torch {m['torch']} ({m['torch_num_threads']} threads), "
           f"load average {m['load_average']} -> {m.get('load_average_end')}; device {m['device']}; {report['date']}; "
           f"{report['completed_prompt_groups']} prompt groups.", ""]
    if report.get("error"):
        out += [f"**Aborted:** {report['error']}", ""]
    tuned = report.get("config", {}).get("tuned_options")
    if tuned:
        out += ["Options from the model's tuned policy defaults (`policy_defaults.json`): " + "; ".join(
            f"{label} " + ", ".join(f"{k}={v}" for k, v in opts.items()) for label, opts in tuned.items()) + ".", ""]
    if not rows:
        return "\n".join(out + ["No completed prompt groups.", ""])
    head = "| Method | " + " | ".join(DATASET_TITLES.get(d, d) for d in datasets) + " | Mean |"
    sep = "|---" * (len(datasets) + 2) + "|"
    out += ["## Table 1: tokens/s (speedup vs ar)", ""]
    for t in temps:
        out += [f"Temperature {t:g}", "", head, sep]
        for meth in methods:
            cells = [cell.get((d, meth, t)) for d in datasets]
            sp = [c["speedup_vs_ar"] for c in cells if c and c["speedup_vs_ar"] is not None]
            text = [f"{c['tokens_per_s']:.1f} ({_fmt(c['speedup_vs_ar'])}x)" if c else "-" for c in cells]
            name = f"{meth} (analysis)" if cells and cells[0] and cells[0]["analysis_only"] else meth
            out.append(f"| {name} | " + " | ".join(text) + f" | {_fmt(np.mean(sp) if sp else None)}x |")
        out.append("")
    out += ["## Table 2: mean accepted tokens per step (Mat, bonus included)", ""]
    for t in temps:
        out += [f"Temperature {t:g}", "", head, sep]
        for meth in methods:
            cells = [cell.get((d, meth, t)) for d in datasets]
            mats = [c["mean_accepted_tokens"] for c in cells if c]
            out.append(f"| {meth} | " + " | ".join(_fmt(c["mean_accepted_tokens"]) if c else "-" for c in cells)
                       + f" | {_fmt(np.mean(mats) if mats else None)} |")
        out.append("")
    out += ["## Step anatomy (mean over datasets)", "",
            "| T | Method | verified/step | unique experts/layer | draft ms | predictor ms | select ms | verify ms | "
            "commit ms | predictor acc | plain steps | vs eagle3 |", "|---" * 12 + "|"]
    for t in temps:
        for meth in methods:
            cs = [cell[(d, meth, t)] for d in datasets if (d, meth, t) in cell]
            mean = lambda k: _fmt(np.mean([c[k] for c in cs if c[k] is not None]) if any(c[k] is not None for c in cs) else None)  # noqa: E731
            out.append(f"| {t:g} | {meth} | {mean('verified_tokens')} | {mean('unique_experts_per_layer')} | "
                       f"{mean('draft_ms')} | {mean('predictor_ms')} | {mean('select_ms')} | {mean('verify_ms')} | "
                       f"{mean('commit_ms')} | {mean('predictor_topk_acc')} | {mean('plain_step_fraction')} | "
                       f"{mean('speedup_vs_eagle3')}x |")
    out.append("")
    return "\n".join(out)


def summary_lines(report: dict) -> list[str]:
    """Short console summary: one line per cell."""
    lines = []
    for r in report["results"]:
        lines.append(f"T={r['temperature']:g} {r['dataset']:>9} {r['method']:<22} {r['tokens_per_s']:8.1f} tok/s "
                     f"x{_fmt(r['speedup_vs_ar'])} vs ar | Mat {r['mean_accepted_tokens']:.2f} | "
                     f"verified {r['verified_tokens']:.1f} | U/layer {r['unique_experts_per_layer']:.1f}")
    return lines
