"""Train an embedded model family (``moespec-tiny``, ``moespec-base``) on this CPU.

``--family`` (before the subcommand; default ``tiny``) picks the target's shape
(``training/target.py: FAMILIES``), the run folder ``runs/<family>/`` and the shipped
directory ``trtllm_moespec/assets/moespec-<family>/``; moespec-base's commands are in
its assets README. Subcommands (run in this order; every step is seeded and the training steps are
resumable with ``--resume``):

  python build_scripts/train_model.py tokenizer --out runs/tiny
  python build_scripts/train_model.py target --minutes 60 --out runs/tiny/target
  python build_scripts/train_model.py export-target --run runs/tiny/target
  python build_scripts/train_model.py predictor --minutes 10 --out runs/tiny/predictor
  python build_scripts/train_model.py export-predictor --run runs/tiny/predictor
  python build_scripts/train_model.py report --out runs/tiny/report.json
  python build_scripts/train_model.py eagle3 --minutes 25 --out runs/tiny/eagle3
  python build_scripts/train_model.py export-eagle3 --run runs/tiny/eagle3
  python build_scripts/train_model.py eval-eagle3 --prompts 10 --max-tokens 96
  python build_scripts/train_model.py predictor-head --minutes 6 --out runs/tiny/predictor_head
  python build_scripts/train_model.py export-predictor-head --run runs/tiny/predictor_head
  python build_scripts/train_model.py eval-predictors

Outputs go to runs/tiny/ (git-ignored); the export steps write the shipped
directories under trtllm_moespec/assets/moespec-tiny/.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ASSETS = REPO / "trtllm_moespec" / "assets"


def cmd_tokenizer(args: argparse.Namespace) -> None:
    from trtllm_moespec.training import corpus, data, tokenizer

    start = time.time()
    split = corpus.split_by_file(corpus.stdlib_root(), args.heldout_fraction, args.seed)
    print(f"corpus {split.root}: {len(split.train)} train files, {len(split.heldout)} held-out files")
    if args.reuse:  # a family that shares another's vocabulary (moespec-base: moespec-tiny's)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(args.reuse / "tokenizer.json"))
    else:
        tok = tokenizer.train_bpe(corpus.read_documents(split.root, split.train), args.vocab_size)
    tokenizer.save_pretrained(tok, args.out / "tokenizer")
    (args.out / "split_heldout.txt").write_text("\n".join(split.heldout) + "\n")
    streams = data.build_streams(tok, split)
    data.save_streams(streams, args.out / "data")
    print(
        f"train {len(streams.train)} tokens ({len(streams.train) / streams.num_train_bytes:.3f} tok/byte), "
        f"held-out {len(streams.heldout)} tokens; {time.time() - start:.0f}s"
    )


def cmd_target(args: argparse.Namespace) -> None:
    from dataclasses import replace

    from trtllm_moespec.training.target import FAMILIES
    from trtllm_moespec.training.train_target import TrainConfig, train_target

    cfg = TrainConfig(
        minutes=args.minutes, seq_len=args.seq_len, batch_size=args.batch_size, peak_lr=args.lr, seed=args.seed,
        extend_minutes=args.extend_minutes, extend_peak_lr=args.extend_lr, init_from=str(args.init_from or ""),
        train_layers=_train_layers(args.train_layers),
    )
    if args.extend_minutes > 0 and not args.resume:
        raise SystemExit("--extend-minutes needs --resume")
    if args.init_from and args.resume:
        raise SystemExit("--init-from starts a new run; --resume continues one")
    shape = replace(FAMILIES[args.family], router_aux_loss_coef=args.aux_coef)
    final = train_target(args.data, args.out, shape, cfg, resume=args.resume)
    print(f"target: step {final.step}, {final.tokens_seen} tokens, {final.elapsed_s:.0f}/{final.planned_s:.0f}s")


def _train_layers(spec: str) -> tuple[int, ...]:
    from trtllm_moespec.training.target import parse_layers

    try:
        return parse_layers(spec)
    except ValueError as e:
        raise SystemExit(f"--train-layers: {e}") from None


def cmd_export_target(args: argparse.Namespace) -> None:
    from trtllm_moespec.training.export import export_target

    out = export_target(args.run, args.tokenizer, args.out)
    print(f"exported target to {out}: {_dir_mb(out):.2f} MB")


def cmd_predictor(args: argparse.Namespace) -> None:
    from trtllm_moespec.training.train_predictor import PredictorTrainConfig, train_predictor

    cfg = PredictorTrainConfig(minutes=args.minutes, train_windows=args.train_windows, seed=args.seed)
    _, final = train_predictor(args.target, args.data, args.out, cfg, resume=args.resume)
    print(f"predictor: step {final.step}, {final.tokens_seen} tokens, {final.elapsed_s:.0f}s, held-out loss {final.best_heldout_loss:.4f}")


def cmd_export_predictor(args: argparse.Namespace) -> None:
    from trtllm_moespec.training.export import export_predictor

    out = export_predictor(args.run, args.out)
    print(f"exported predictor to {out}: {_dir_mb(out):.2f} MB")


def cmd_report(args: argparse.Namespace) -> None:
    from trtllm_moespec.training.report import build_report

    build_report(args.target, args.predictor, args.data, args.out, args.max_windows, args.reps, args.ablation_windows)


def _dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def main() -> None:
    family_parser = argparse.ArgumentParser(add_help=False)
    family_parser.add_argument("--family", choices=("tiny", "base"), default="tiny", help="model family (default tiny)")
    family = family_parser.parse_known_args()[0].family
    asset_dir, runs = ASSETS / f"moespec-{family}", Path("runs") / family
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, parents=[family_parser])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("tokenizer", help="train the BPE tokenizer and encode the corpus")
    p.add_argument("--out", type=Path, default=runs)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--reuse", type=Path, default=None, help="encode with the tokenizer of this directory instead of training one")
    p.add_argument("--heldout-fraction", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_tokenizer)
    p = sub.add_parser("target", help="train the tiny Qwen3-MoE target (time-bounded, resumable)")
    p.add_argument("--out", type=Path, default=Path(runs / "target"))
    p.add_argument("--data", type=Path, default=Path(runs / "data"))
    p.add_argument("--minutes", type=float, default=60.0, help="training time: the schedule length at the first launch, the session budget with --resume")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--aux-coef", type=float, default=0.03)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt with its schedule")
    p.add_argument("--threads", type=int, default=2, help="torch threads (1 keeps a core free for other work)")
    p.add_argument("--init-from", type=Path, default=None, help="start a new run from an exported target: the same shape (a later segment on a fresh machine) or moespec-tiny's (depth/expert up-scaling)")
    p.add_argument("--extend-minutes", type=float, default=0.0, help="with --resume: append a new cosine segment")
    p.add_argument("--extend-lr", type=float, default=1e-3, help="starting lr of the appended segment")
    p.add_argument("--train-layers", default="", help="train only these decoder layers, e.g. 2-5,8-11 (the rest frozen; "
                   "default: all)")
    p.set_defaults(fn=cmd_target)
    p = sub.add_parser("export-target", help="write the fp16 target + tokenizer into the package assets")
    p.add_argument("--run", type=Path, default=Path(runs / "target"))
    p.add_argument("--tokenizer", type=Path, default=Path(runs / "tokenizer"))
    p.add_argument("--out", type=Path, default=asset_dir / "target")
    p.set_defaults(fn=cmd_export_target)
    p = sub.add_parser("predictor", help="trace the exported target's routing and train the expert predictor")
    p.add_argument("--target", type=Path, default=asset_dir / "target")
    p.add_argument("--data", type=Path, default=Path(runs / "data"))
    p.add_argument("--out", type=Path, default=Path(runs / "predictor"))
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--train-windows", type=int, default=1024, help="256-token windows of routing traces")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.set_defaults(fn=cmd_predictor)
    p = sub.add_parser("export-predictor", help="write the fp16 predictor into the package assets")
    p.add_argument("--run", type=Path, default=Path(runs / "predictor"))
    p.add_argument("--out", type=Path, default=asset_dir / "predictor")
    p.set_defaults(fn=cmd_export_predictor)
    p = sub.add_parser("report", help="held-out loss, expert utilisation, C(k) curve, predictor accuracy and latency")
    p.add_argument("--target", type=Path, default=asset_dir / "target")
    p.add_argument("--predictor", type=Path, default=asset_dir / "predictor")
    p.add_argument("--data", type=Path, default=Path(runs / "data"))
    p.add_argument("--out", type=Path, default=Path(runs / "report.json"))
    p.add_argument("--max-windows", type=int, default=None, help="limit the held-out 512-token windows (default: all)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per k and offset")
    p.add_argument("--ablation-windows", type=int, default=0, help="256-token held-out windows on which every layer and expert is removed in turn (0 = skip)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (1 keeps a core free; the C(k) curve is timed at this count)")
    p.set_defaults(fn=cmd_report)
    from trtllm_moespec.training.eagle3_cli import add_subcommands as add_eagle3_subcommands

    add_eagle3_subcommands(sub, asset_dir, runs)  # eagle3, export-eagle3, eval-eagle3, predictor-head, ...
    args = parser.parse_args()
    torch.set_num_threads(args.threads if hasattr(args, "threads") else 2)
    args.fn(args)


if __name__ == "__main__":
    main()
