"""The cost regime of each CPU model beside a real deployment: C(k) / plain step against k.

C(k) is the cost of a speculative step that verifies k drafted nodes (draft + select + verify +
commit), divided by the cost of one plain decoding step of the same model. The CPU models' curves
are their measured cost profiles (`moespec profile`); the deployment curve is the roofline estimate
of Qwen3-30B-A3B on an H200 (`roofline:H200`: bf16 weights, uniform routing, 2048 tokens of context),
with the drafter's forwards added at `--deploy-draft-ratio` of a plain step each (one EAGLE-3 layer
against 48 target layers: ~1/30), so every curve counts the same things.

    python -m benchmarks.regime_plot [--profiles tiny=PATH,base=PATH] [--out benchmarks/results/regime.png]
Prints a table, then one JSON line (also written beside the figure).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trtllm_moespec.assets import ASSETS_DIR
from trtllm_moespec.core.cost import RooflineCostModel
from trtllm_moespec.core.presets import architecture

KS = (0, 1, 2, 4, 8, 16, 32)


def profile_curve(path: Path) -> dict:
    """C(k) / plain step of a measured profile, and its drafter forward / plain step."""
    profile = json.loads(path.read_text())
    plain = profile["plain_step"]
    return {"ratio": [c / plain for c in profile["costs"]], "draft_ratio": profile["draft_forward"] / plain,
            "plain_ms": plain * 1e3, "source": str(path)}


def roofline_curve(arch: str, device: str, max_k: int, draft_ratio: float, drafts_per_step: int) -> dict:
    """C(k) / plain step of the roofline verify plus the drafter's forwards at `draft_ratio` each."""
    model = RooflineCostModel.for_device(architecture(arch), device)
    plain = model.step_seconds(1, model.expected_unique(1), 2048)
    verify = [model.step_seconds(k + 1, model.expected_unique(k + 1), 2048) / plain for k in range(max_k + 1)]
    return {"ratio": [v + drafts_per_step * draft_ratio for v in verify], "draft_ratio": draft_ratio,
            "plain_ms": plain * 1e3, "source": f"roofline:{device} {arch}, {drafts_per_step} drafter forwards per step"}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default=f"moespec-tiny={ASSETS_DIR / 'moespec-tiny' / 'cost_profile.json'},"
                                          f"moespec-base={ASSETS_DIR / 'moespec-base' / 'cost_profile.json'}")
    ap.add_argument("--deploy", default="qwen3-30b-a3b", help="architecture preset of the deployment curve")
    ap.add_argument("--device", default="H200")
    ap.add_argument("--deploy-draft-ratio", type=float, default=1 / 30)
    ap.add_argument("--drafts-per-step", type=int, default=4, help="drafter forwards per step (tree steps 4)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/regime.png"))
    args = ap.parse_args(argv)
    curves = {name: profile_curve(Path(path)) for name, path in (item.split("=", 1) for item in args.profiles.split(","))}
    max_k = min(len(c["ratio"]) for c in curves.values()) - 1
    curves[f"{args.deploy} {args.device} (roofline)"] = roofline_curve(args.deploy, args.device, max_k,
                                                                      args.deploy_draft_ratio, args.drafts_per_step)
    print(f"{'model':<34} {'draft/plain':>11} " + " ".join(f"C({k})".rjust(6) for k in KS if k <= max_k))
    for name, c in curves.items():
        print(f"{name:<34} {c['draft_ratio']:>11.3f} " + " ".join(f"{c['ratio'][k]:>6.2f}" for k in KS if k <= max_k))
    _plot(curves, args.out)
    result = {"benchmark": "regime", "curves": curves}
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


def _plot(curves: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, c in curves.items():
        style = "--" if "roofline" in name else "-"
        ax.plot(range(len(c["ratio"])), c["ratio"], style, label=f"{name} (drafter {c['draft_ratio']:.2f} of a step)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("drafted nodes verified per step, k")
    ax.set_ylabel("C(k) / plain decoding step")
    ax.set_title("Cost of a speculative step: CPU models vs a real deployment")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
