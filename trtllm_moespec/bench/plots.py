"""Benchmark figures (matplotlib, Agg, PNG) drawn from a report dict.

- cost_vs_tree_size.png   step / verify latency and unique experts per layer vs verified
                          tree size, from every per-step record (EVICT Fig. 1)
- verified_vs_mat.png     mean verified tokens per step vs Mat, per method (EVICT Fig. 5a)
- tokens_per_s.png        tokens/s per dataset per method, one panel per temperature
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(report: dict, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not report["results"]:
        return []
    plt = _pyplot()
    paths = [_cost_vs_tree_size(plt, report, out / "cost_vs_tree_size.png"),
             _verified_vs_mat(plt, report, out / "verified_vs_mat.png"),
             _tokens_per_s(plt, report, out / "tokens_per_s.png")]
    return paths


def _cost_vs_tree_size(plt, report: dict, path: Path) -> Path:
    k, step, verify, unique = [], [], [], []
    for rec in report["steps"]:
        if rec["method"] == "oracle" or "predictor=oracle" in rec["method"]:
            continue  # their steps include extra analysis forwards
        k += rec["verified_tokens"]
        step += rec["step_ms"]
        verify += rec["verify_ms"]
        unique += rec["unique_experts_per_layer"]
    k, step, verify, unique = map(np.asarray, (k, step, verify, unique))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    sizes = np.unique(k) if k.size else np.array([])
    med = lambda v: [float(np.median(v[k == s])) for s in sizes]  # noqa: E731
    ax.plot(sizes, med(step), "o-", label="step (draft+select+verify+commit)")
    ax.plot(sizes, med(verify), "s-", label="verify forward")
    ax.set_xlabel("verified draft tokens per step")
    ax.set_ylabel("median latency (ms)")
    ax2 = ax.twinx()
    ax2.plot(sizes, [float(np.mean(unique[k == s])) for s in sizes], "^--", color="tab:red", label="unique experts")
    ax2.set_ylabel("unique experts per layer", color="tab:red")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("Step cost vs verified tree size (all methods' steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _verified_vs_mat(plt, report: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    methods = list(dict.fromkeys(r["method"] for r in report["results"]))
    for meth in methods:
        rs = [r for r in report["results"] if r["method"] == meth]
        ax.scatter([r["verified_tokens"] for r in rs], [r["mean_accepted_tokens"] for r in rs], label=meth, s=28)
    ax.set_xlabel("verified tokens per step")
    ax.set_ylabel("mean accepted tokens per step (Mat)")
    ax.set_title("Verification budget vs acceptance (one point per dataset x temperature)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tokens_per_s(plt, report: dict, path: Path) -> Path:
    rows = report["results"]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    temps = sorted(dict.fromkeys(r["temperature"] for r in rows))
    cell = {(r["dataset"], r["method"], r["temperature"]): r["tokens_per_s"] for r in rows}
    fig, axes = plt.subplots(1, len(temps), figsize=(6.0 * len(temps), 4.6), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    width = 0.8 / max(len(methods), 1)
    for ax, t in zip(axes[0], temps):
        x = np.arange(len(datasets))
        for i, meth in enumerate(methods):
            ax.bar(x + i * width, [cell.get((d, meth, t), 0.0) for d in datasets], width, label=meth,
                   color=colors[i % len(colors)])
        ax.set_xticks(x + width * (len(methods) - 1) / 2)
        ax.set_xticklabels(datasets)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"temperature {t:g}")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
