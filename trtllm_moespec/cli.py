"""The `moespec` command: generate, profile, bench, build, triton-repo.

Every subcommand turns bad input into a one-line error and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="moespec-tiny", help="local HF directory or 'moespec-tiny' (default)")
    p.add_argument("--draft-model", default=None, help="EAGLE-3 drafter directory (SpecForge format)")
    p.add_argument("--drafter", default="eagle3", choices=["eagle3", "ngram"])
    p.add_argument("--policy", default="joint", help="ar, eagle3, ddd, evict, ecospec, joint, coverage, oracle")
    p.add_argument("--tree", default="4,8,32", help="steps,topk,max_draft_tokens (default 4,8,32)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cost-profile", default=None, help="cost_profile.json, or roofline:H200 for an estimate")
    p.add_argument("--override-profile", action="store_true", help="use a profile made for another setting")
    p.add_argument("--predictor", default=None, help="expert predictor directory, or 'oracle' (analysis only)")
    p.add_argument("--values", default="calibrated", choices=["raw", "calibrated", "head"],
                   help="node values of the cost-aware policies: calibrated acceptance probability (default), the "
                        "learned acceptance head, or raw draft path scores (ablation)")
    p.add_argument("--guard", default="auto", choices=["auto", "measured", "profiled", "off"],
                   help="speculate-or-not before each step: auto (default) = the measured goodput guard for the "
                        "cost-aware policies, off for eagle3; profiled = k=0 on the profiled costs only")
    p.add_argument("--draft-stop", default=None, action=argparse.BooleanOptionalAction,
                   help="stop drafting when another drafter forward cannot pay (default: on for the cost-aware "
                        "policies when the cost profile has the drafter-forward cost)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on CPU (default 1: small models gain nothing from more, and a "
                        "shared CPU makes OpenMP barriers stall)")


def _llm_from_args(args):
    import torch

    from .api import LLM
    from .engine.config import TreeConfig

    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the CLI streams text; weight-loading bars would interleave with it

    return LLM(model=args.model, draft_model=args.draft_model, policy=args.policy, tree=TreeConfig.parse(args.tree),
               device=args.device, dtype=args.dtype, cost_profile=args.cost_profile, predictor=args.predictor,
               drafter=args.drafter, override_profile=args.override_profile, values=args.values, guard=args.guard,
               draft_stop=args.draft_stop)


def cmd_generate(args) -> int:
    from .api import SamplingParams

    if args.prompt is None and args.prompt_file is None:
        args.prompt = "def fibonacci(n):\n"
    prompt = args.prompt if args.prompt is not None else open(args.prompt_file, encoding="utf-8").read()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    llm = _llm_from_args(args)
    out = None
    if not args.json:
        sys.stdout.write(prompt)
    for event in llm.stream(prompt, params):
        if event.output is not None:
            out = event.output
        elif not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "stats": out.stats.to_dict()}))
    else:
        print(f"\n[{args.policy}] {out.stats.summary()}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moespec", description="MoE-aware tree speculative decoding")
    parser.add_argument("--version", action="version", version=f"trtllm-moespec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, streaming it, and print a stats line")
    _add_model_args(g)
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-file", default=None)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=cmd_generate)

    _add_optional_commands(sub)
    return parser


def _add_optional_commands(sub) -> None:
    """Subcommands whose modules live beside the engine (profiling, benchmarks, TensorRT-LLM tools)."""
    import importlib

    for name, module, help_text in (
        ("profile", "trtllm_moespec.profiling", "measure C(k) and fit the expert cost model on this device"),
        ("bench", "trtllm_moespec.bench", "benchmark every method side by side (also: python -m benchmarks.run)"),
        ("build", "trtllm_moespec.backends.trtllm.build", "write a TensorRT-LLM engine directory"),
        ("triton-repo", "trtllm_moespec.runtime.triton_repo", "write a Triton Inference Server model repository"),
    ):
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.set_defaults(func=lambda args, extra, m=module: importlib.import_module(m).main(extra), passthrough=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        if getattr(args, "passthrough", False):
            return int(args.func(args, extra) or 0)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"moespec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
