"""`build_scripts/train_model.py` subcommands of the EAGLE-3 drafter and the draft-head predictor:

  eagle3                  train the drafter against the exported target (time-bounded, resumable)
  export-eagle3           write it (fp16, SpecForge format, shared embedding) into the package assets
  eval-eagle3             Mat and per-position acceptance on HumanEval prompts (EAGLE-3 tree, T = 0)
  predictor-head          train our expert-predictor head on the drafter's hidden states
  export-predictor-head   write it (fp16) into the package assets
  eval-predictors         ms per step and online top-K hit rate of both predictors (ecospec policy)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_subcommands(sub, asset_dir: Path, runs: Path) -> None:
    p = sub.add_parser("eagle3", help="train the EAGLE-3 drafter of the exported target (training-time test)")
    p.add_argument("--target", type=Path, default=asset_dir / "target")
    p.add_argument("--data", type=Path, default=Path(runs / "data"))
    p.add_argument("--out", type=Path, default=Path(runs / "eagle3"))
    p.add_argument("--minutes", type=float, default=25.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--ttt-steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--selfgen", type=int, default=0, help="self-distillation windows (target greedy continuations; slow here)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--extend-minutes", type=float, default=0.0, help="with --resume: append a new cosine segment "
                   "(e.g. after the target was trained further: the drafter follows it)")
    p.add_argument("--extend-lr", type=float, default=1e-3, help="starting lr of the appended segment")
    p.add_argument("--init-from", type=Path, default=None, help="start a new run from an exported drafter (e.g. the "
                   "shipped one: a later training segment on a machine without the run's checkpoint)")
    p.set_defaults(fn=cmd_eagle3)
    p = sub.add_parser("export-eagle3", help="write the drafter into the package assets (fp16)")
    p.add_argument("--run", type=Path, default=Path(runs / "eagle3"))
    p.add_argument("--target", type=Path, default=asset_dir / "target")
    p.add_argument("--out", type=Path, default=asset_dir / "eagle3")
    p.set_defaults(fn=cmd_export_eagle3)
    p = sub.add_parser("eval-eagle3", help="Mat and per-position acceptance on HumanEval prompts")
    p.add_argument("--target", type=Path, default=asset_dir / "target")
    p.add_argument("--drafter", type=Path, default=asset_dir / "eagle3")
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--tree", default="4,8,32", help="steps,topk,max_draft_tokens")
    p.add_argument("--out", type=Path, default=Path(runs / "eagle3/acceptance.json"))
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(fn=cmd_eval_eagle3)
    p = sub.add_parser("predictor-head", help="train our expert-predictor head on the drafter's hidden states")
    p.add_argument("--target", type=Path, default=asset_dir / "target")
    p.add_argument("--drafter", type=Path, default=asset_dir / "eagle3")
    p.add_argument("--data", type=Path, default=Path(runs / "data"))
    p.add_argument("--out", type=Path, default=Path(runs / "predictor_head"))
    p.add_argument("--minutes", type=float, default=6.0)
    p.add_argument("--train-windows", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(fn=cmd_predictor_head)
    p = sub.add_parser("export-predictor-head", help="write the head predictor into the package assets (fp16)")
    p.add_argument("--run", type=Path, default=Path(runs / "predictor_head"))
    p.add_argument("--out", type=Path, default=asset_dir / "predictor-head")
    p.set_defaults(fn=cmd_export_predictor_head)
    p = sub.add_parser("eval-predictors", help="ms per step and online top-K hit rate of both expert predictors")
    p.add_argument("--target", type=Path, default=asset_dir / "target")
    p.add_argument("--drafter", type=Path, default=asset_dir / "eagle3")
    p.add_argument("--standalone", type=Path, default=asset_dir / "predictor")
    p.add_argument("--head", type=Path, default=asset_dir / "predictor-head")
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path(runs / "predictor_head/online.json"))
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(fn=cmd_eval_predictors)


def cmd_eagle3(args: argparse.Namespace) -> None:
    from .train_eagle3 import Eagle3TrainConfig, train_eagle3

    cfg = Eagle3TrainConfig(minutes=args.minutes, batch_size=args.batch_size, seq_len=args.seq_len,
                            ttt_steps=args.ttt_steps, peak_lr=args.lr, seed=args.seed,
                            selfgen_sequences=args.selfgen, extend_minutes=args.extend_minutes,
                            extend_peak_lr=args.extend_lr, init_from=str(args.init_from or ""))
    if args.extend_minutes > 0 and not args.resume:
        raise SystemExit("--extend-minutes needs --resume")
    if args.init_from is not None and args.resume:
        raise SystemExit("--init-from starts a new run; --resume continues one")
    _, final = train_eagle3(args.target, args.data, args.out, cfg, resume=args.resume)
    print(f"eagle3: step {final.step}, {final.tokens_seen} tokens, {final.elapsed_s:.0f}/{final.planned_s:.0f}s, "
          f"held-out loss {final.best_heldout_loss:.4f}")


def cmd_export_eagle3(args: argparse.Namespace) -> None:
    from .train_eagle3 import export_eagle3

    out = export_eagle3(args.run, args.target, args.out)
    print(f"exported drafter to {out}: {_dir_mb(out):.2f} MB")


def cmd_eval_eagle3(args: argparse.Namespace) -> None:
    from ..engine.config import TreeConfig
    from .eval_eagle3 import measure_acceptance

    report = measure_acceptance(args.target, args.drafter, args.prompts, args.max_tokens, TreeConfig.parse(args.tree))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    print(json.dumps(report.to_dict(), indent=2))


def cmd_predictor_head(args: argparse.Namespace) -> None:
    from .train_predictor_head import HeadTrainConfig, train_predictor_head

    cfg = HeadTrainConfig(minutes=args.minutes, train_windows=args.train_windows, seed=args.seed)
    _, metrics = train_predictor_head(args.target, args.drafter, args.data, args.out, cfg)
    print(json.dumps(metrics, indent=2))


def cmd_export_predictor_head(args: argparse.Namespace) -> None:
    from .train_predictor_head import export_predictor_head

    out = export_predictor_head(args.run, args.out)
    print(f"exported head predictor to {out}: {_dir_mb(out):.2f} MB")


def cmd_eval_predictors(args: argparse.Namespace) -> None:
    from .eval_eagle3 import measure_predictors

    predictors = {name: path for name, path in (("standalone", args.standalone), ("draft_head", args.head))
                  if (path / "config.json").is_file()}
    for name in {"standalone", "draft_head"} - set(predictors):
        print(f"skipping the {name} predictor: no config.json in its directory")
    results = measure_predictors(args.target, args.drafter, predictors, args.prompts, args.max_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


def _dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20

