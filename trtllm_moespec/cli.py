"""The `moespec` command: generate, profile, bench, build, triton-repo.

Every subcommand turns bad input into a one-line error and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from .assets import DEFAULT_MODEL, SHIPPED_MODELS
from . import __version__


# The policies `LLM` accepts (api.METHODS; a test keeps the two equal). Listed here so that `--help` and
# argument errors do not wait for torch to import.
POLICY_CHOICES = ("ar", "coverage", "ddd", "eagle3", "ecospec", "evict", "joint", "oracle")
# Selections across a batch of requests: only `moespec serve` runs batches (serve.server maps each to
# the per-request policy it loads and the batched engine it drives).
BATCH_POLICY_CHOICES = ("joint-batch", "evict-batch", "ecospec-batch")  # = engine.batch.BATCH_POLICIES
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
DEFAULT_PROMPT = "def fibonacci(n):\n"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the project's rule for bad input), exit code 2 as argparse's."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Shows "(default: X)" unless the help already says what the default is, or there is none."""

    def _get_help_string(self, action):
        text, default = action.help or "", action.default
        if default is None or default is False or default is argparse.SUPPRESS or "default" in text:
            return text
        if isinstance(default, (tuple, list)):
            default = ",".join(str(x) for x in default) or "none"
        return f"{text} (default: {str(default).replace('%', '%%')})"


def _bounded_int(low: int, high: int | None = None):
    """argparse type: an integer in [low, high) (high None: no upper bound); checked before torch imports."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value >= high):
            bound = f">= {low}" if high is None else f"in [{low}, {_power_of_two(high)})"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text}")
        return value
    return parse


def _power_of_two(n: int) -> str:
    return f"2**{n.bit_length() - 1}" if n > 1024 and n & (n - 1) == 0 else str(n)


def _tree(text: str):
    from .engine.config import TreeConfig  # torch-free

    try:
        return TreeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _device(text: str) -> str:
    if re.fullmatch(r"cpu|cuda(:\d+)?", text) is None:
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; use cpu, cuda or cuda:N")
    return text


def _add_model_args(p: argparse.ArgumentParser, batch_policies: bool = False) -> None:
    """The model options every command shares; `batch_policies` adds the batch-level selections."""
    policies = POLICY_CHOICES + (BATCH_POLICY_CHOICES if batch_policies else ())
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"local HF directory or an embedded model ({', '.join(SHIPPED_MODELS)}; default {DEFAULT_MODEL})")
    p.add_argument("--draft-model", default=None,
                   help="EAGLE-3 drafter directory (SpecForge format); default: the model's own, if it has one")
    p.add_argument("--drafter", default="eagle3", choices=["eagle3", "ngram"],
                   help="draft with the EAGLE-3 head or a weightless prompt-lookup (n-gram) drafter")
    p.add_argument("--policy", default="joint", choices=policies, metavar="{" + ",".join(policies) + "}",
                   help="which draft nodes to verify each step (see the README's policy table)"
                        + ("; X-batch: X's nodes chosen across the whole batch" if batch_policies else ""))
    p.add_argument("--tree", default=None, type=_tree,
                   help="steps,topk,max_draft_tokens of the draft tree (at most 4096 drafted nodes; default: the "
                        "model's, the tree its cost profile was measured with: 6,8,32 for moespec-base)")
    p.add_argument("--device", default="cpu", type=_device, help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES, help="weights and activations")
    p.add_argument("--model-impl", default="lean", choices=["lean", "hf"],
                   help="target forward: lean (ours, static KV cache) or hf (transformers, the reference)")
    p.add_argument("--cuda-graphs", default=None, action=argparse.BooleanOptionalAction,
                   help="replay the verify forward from one CUDA graph per verify-length bucket (default: on for "
                        "--device cuda with --model-impl lean, off otherwise)")
    p.add_argument("--cost-profile", default=None,
                   help="cost_profile.json for evict/joint (default: the model's own), or roofline:H200 for an "
                        "unmeasured estimate")
    p.add_argument("--override-profile", action="store_true", help="use a profile made for another setting")
    p.add_argument("--predictor", default=None,
                   help="expert predictor directory for ecospec/joint (default: the model's own), or 'oracle' "
                        "(analysis only)")
    p.add_argument("--values", default=None, choices=["raw", "calibrated", "head"],
                   help="node values of the cost-aware policies: calibrated acceptance probability, the "
                        "learned acceptance head, or raw draft path scores (ablation); default: the model's "
                        "choice for its tree and device (moespec-base: head on CPU), else calibrated")
    p.add_argument("--guard", default="auto", choices=["auto", "measured", "profiled", "off"],
                   help="speculate-or-not before each step: auto (default) = the measured goodput guard for the "
                        "cost-aware policies, off for eagle3; profiled = k=0 on the profiled costs only")
    p.add_argument("--draft-stop", default=None, action=argparse.BooleanOptionalAction,
                   help="cost-aware policies: stop drafting when more drafter forwards cannot pay, on the "
                        "profile's costs and the node values (default: off, see docs/guard.md)")
    p.add_argument("--threads", type=_bounded_int(1), default=1,
                   help="torch intra-op threads on CPU (small models gain nothing from more, and a shared CPU "
                        "makes OpenMP barriers stall)")


def _llm_from_args(args, ep=None):
    from transformers.utils import logging as hf_logging

    from .api import LLM

    hf_logging.disable_progress_bar()  # the CLI streams text; weight-loading bars would interleave with it
    return LLM(model=args.model, draft_model=args.draft_model, policy=args.policy, tree=args.tree,
               device=args.device, dtype=args.dtype, cost_profile=args.cost_profile, predictor=args.predictor,
               drafter=args.drafter, override_profile=args.override_profile, values=args.values,
               model_impl=args.model_impl, threads=args.threads, ep=ep, ep_pricing=getattr(args, "ep_pricing", True),
               guard=args.guard, draft_stop=args.draft_stop, cuda_graphs=args.cuda_graphs,
               prefix_cache=getattr(args, "prefix_cache", 0))


def read_prompt_file(path: str, flag: str = "--prompt-file") -> str:
    """The text of a file named on the command line, with errors that name the flag and the file."""
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a directory, not a text file")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise ValueError(f"{flag} {path} cannot be read: {e.strerror or e}") from None


def _structured(args):
    """--json-schema / --regex / --choice -> a StructuredOutput (None: free text)."""
    from .engine.structured import StructuredOutput

    schema = None if args.json_schema is None else read_prompt_file(args.json_schema, "--json-schema")
    try:
        return StructuredOutput.of(json_schema=schema, regex=args.regex, choice=args.choice)
    except ValueError as e:
        raise ValueError(f"--json-schema {args.json_schema}: {e}" if schema is not None else str(e)) from None


def cmd_generate(args) -> int:
    if args.prompt is not None:
        prompt = args.prompt
    elif args.prompt_file is not None:
        prompt = read_prompt_file(args.prompt_file)
    else:
        prompt = DEFAULT_PROMPT
    from .parallel.run import launch_ep_size

    ep = launch_ep_size(args.ep, args.model)  # a bad launch fails before loading anything
    from .api import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop, repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            min_p=args.min_p, structured=_structured(args))
    if ep > 1:
        from .parallel.run import run_expert_parallel

        return run_expert_parallel(args.device, args.threads, lambda ctx: _generate(args, prompt, params, ctx))
    return _generate(args, prompt, params, None)


def _generate(args, prompt: str, params, ep) -> int:
    llm = _llm_from_args(args, ep)
    ids = llm.encode(prompt)[0]
    llm.make_request(ids, params)  # checks length and ids now, so a refused prompt is not echoed first
    out = None
    if not args.json:
        sys.stdout.write(prompt)
    for event in llm.stream(ids, params):
        if event.output is not None:
            out = event.output
        if not args.json and event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "stats": out.stats.to_dict()}))
    else:
        sys.stdout.flush()
        print(f"\n[{args.policy}] {out.stats.summary()}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moespec", description="MoE-aware tree speculative decoding")
    parser.add_argument("--version", action="version", version=f"trtllm-moespec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, streaming it, and print a stats line",
                       description="Generate text with speculative decoding, streaming it to stdout; a stats line "
                                   "goes to stderr.", formatter_class=DefaultsHelpFormatter)
    _add_model_args(g)
    prompt = g.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    prompt.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 text file")
    g.add_argument("--max-tokens", type=_bounded_int(1), default=64, help="most new tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (identical to plain decoding)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 = off")
    g.add_argument("--top-k", type=_bounded_int(0), default=0, help="sample among the k most likely tokens; 0 = off")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens with probability >= min_p x the most likely one's, in [0, 1]; 0 = off")
    g.add_argument("--seed", type=_bounded_int(0, 2**64), default=None, help="sampling seed in [0, 2**64) (default: nondeterministic)")
    g.add_argument("--stop", action="append", default=None, help="stop string, excluded from the output (repeatable)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0; tokens of the prompt or the output: logit / r if positive, else * r; 1 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]; subtracted once per output token")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2]; subtracted per occurrence in the output")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", default=None, metavar="FILE",
                       help="the output is JSON matching this schema (needs the [structured] extra)")
    shape.add_argument("--regex", default=None, help="the output matches this regular expression")
    shape.add_argument("--choice", action="append", default=None, help="the output is one of these strings (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--ep", type=_bounded_int(1), default=None,
                   help="expert parallelism over N ranks: run as `mpirun -n N moespec generate ... --ep N`")
    g.add_argument("--no-ep-pricing", dest="ep_pricing", action="store_false",
                   help="with --ep: ecospec / joint price the global expert union instead of the busiest rank's")
    g.set_defaults(func=cmd_generate)

    _add_optional_commands(sub)
    return parser


def _add_optional_commands(sub) -> None:
    """Subcommands whose modules live beside the engine (profiling, benchmarks, TensorRT-LLM tools)."""
    import importlib

    for name, module, help_text in (
        ("profile", "trtllm_moespec.profiling", "measure C(k) and fit the expert cost model on this device"),
        ("bench", "trtllm_moespec.bench", "benchmark every method side by side (also: python -m benchmarks.run)"),
        ("replay", "trtllm_moespec.replay", "record decoding steps with the target's verdicts; score policies offline"),
        ("build", "trtllm_moespec.backends.trtllm.build", "write a TensorRT-LLM engine directory"),
        ("triton-repo", "trtllm_moespec.runtime.triton_repo", "write a Triton Inference Server model repository"),
        ("serve", "trtllm_moespec.serve.server", "OpenAI-compatible HTTP server (continuous batching)"),
    ):
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.set_defaults(func=lambda args, extra, m=module: importlib.import_module(m).main(extra), passthrough=True)


def main(argv: list[str] | None = None) -> int:
    """The `moespec` command (argv None: the process's own arguments, and the process ends on return)."""
    rc = _main(argv)
    if argv is None and rc == 130:
        _ignore_sigint()
    return rc


def _ignore_sigint() -> None:
    """Interrupted, and the process is ending: a second Ctrl-C while the interpreter shuts down (joining
    loader threads) would only print an "Exception ignored ... KeyboardInterrupt" traceback."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        if getattr(args, "passthrough", False):
            return int(args.func(args, extra) or 0)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return int(args.func(args) or 0)
    except (ValueError, OSError, KeyError) as e:  # OSError: FileNotFoundError, IsADirectoryError, PermissionError
        if isinstance(e, BrokenPipeError):
            return _broken_pipe()
        print(f"moespec: error: {flag_message(str(e), parser)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if argv is None:
            _ignore_sigint()
        print("\nmoespec: interrupted", file=sys.stderr)
        return 130


def flag_message(message: str, parser: argparse.ArgumentParser) -> str:
    """An error of the Python API in the command line's words: `draft_model=DIR` -> `--draft-model DIR`,
    `cuda_graphs=True` -> `--cuda-graphs`, `presence_penalty must` -> `--presence-penalty must`, for the
    options of `parser` and its subcommands. One-word names (model, policy) are rewritten only in the
    `name=value` form: bare, they are ordinary words of the message."""
    for dest, (flag, negative) in sorted(_option_flags(parser).items(), key=lambda kv: -len(kv[0])):
        head = rf"(?<![\w./-]){re.escape(dest)}"
        if negative is not None:  # a switch: store_true ("" : no negative form) or --x / --no-x
            message = re.sub(head + r"=True\b", flag, message)
            if negative:
                message = re.sub(head + r"=False\b", negative, message)
        message = re.sub(head + r"""=(?:'([^']*)'|"([^"]*)"|([^\s,;)'"]+))""",
                         lambda m: f"{flag} {m[1] if m[1] is not None else m[2] if m[2] is not None else m[3]}", message)
        if "_" in dest:
            message = re.sub(head + r"(?![\w/=])", flag, message)
    return message


def _option_flags(parser: argparse.ArgumentParser) -> dict[str, tuple[str, str | None]]:
    """dest -> (its long flag, None when it takes a value, else the flag that sets it False or "")."""
    flags: dict[str, tuple[str, str | None]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags.update({k: v for k, v in _option_flags(sub).items() if k not in flags})
            continue
        long = [o for o in action.option_strings if o.startswith("--")]
        if not long or action.dest in (argparse.SUPPRESS, "help"):
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            flags[action.dest] = (long[0], next((o for o in long if o.startswith("--no-")), None))
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            flags[action.dest] = (long[0], "")
        else:
            flags[action.dest] = (long[0], None)
    return flags


def _broken_pipe() -> int:
    """stdout's reader went away (`moespec generate | head`): stop quietly, as Unix tools do."""
    import os

    # Python flushes stdout again at exit; point it at /dev/null so that flush cannot fail a second time.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by the pipe


if __name__ == "__main__":
    sys.exit(main())
