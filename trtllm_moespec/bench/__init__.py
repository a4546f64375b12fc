"""`moespec bench` (also `python -m benchmarks.run`): every method side by side on real prompts.

    moespec bench --model moespec-tiny --datasets humaneval,mt_bench,gsm8k \\
        --methods ar,eagle3,evict,ecospec,joint --temperature 0,1 --num-prompts 8 --max-tokens 64 \\
        --json OUT.json --markdown OUT.md --plots DIR

Each method's LLM is built once (same drafter weights and tree for every EAGLE-family
method), warmed up, then methods run interleaved per prompt. At T=0 any method whose
tokens differ from `ar`'s aborts the run (exit 3) with a partial report; Ctrl-C also
leaves a valid partial report (exit 130), and so does SIGTERM, what `timeout`, CI runners
and `kill` send (exit 143). Exit 2 on bad arguments, output paths included (checked before
the run: `outfiles.check_writable`). Exit 1 when the run finished but a report could not be
written where asked: it then went to the temporary directory (or stdout), named on stderr.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path

from ..assets import DEFAULT_MODEL
from ..cli import DefaultsHelpFormatter, flag_message
from .datasets import DATASETS, load_prompts, tokenization_note
from .methods import DEFAULT_METHODS, MethodSpec, ablation_specs, build_runner, method_spec, values_specs
from .runner import BenchState, LosslessMismatch, run_bench, warm_up

__all__ = ["main"]


def _csv(kind):
    def parse(text: str):
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}")
    return parse


def build_parser(prog: str = "moespec bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"local HF directory or an embedded model (default {DEFAULT_MODEL})")
    p.add_argument("--draft-model", default=None, help="EAGLE-3 drafter directory (default: the model's own)")
    p.add_argument("--tree", default=None, help="steps,topk,max_draft_tokens shared by every EAGLE-family method "
                   "(default: the model's, the tree its cost profile was measured with)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--cost-profile", default=None, help="for evict/joint (default: the model's cost_profile.json)")
    p.add_argument("--predictor", default=None, help="expert predictor for ecospec/joint: DIR or 'oracle' "
                                                     "(default: the model's own)")
    p.add_argument("--datasets", type=_csv(str), default=DATASETS, help=f"comma list of {', '.join(DATASETS)}")
    p.add_argument("--methods", type=_csv(str), default=DEFAULT_METHODS,
                   help="comma list of " + ", ".join(DEFAULT_METHODS) + " ('ar' is always run first)")
    p.add_argument("--temperature", type=_csv(float), default=(0.0, 1.0), help="comma list, e.g. 0,1")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per dataset")
    p.add_argument("--max-tokens", type=int, default=64, help="generated tokens per prompt")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each prompt per method (interleaved); the run of median time is kept")
    p.add_argument("--warmup-tokens", type=int, default=16, help="tokens of the untimed warm-up per method and temperature")
    p.add_argument("--seed", type=int, default=0, help="per-prompt sampling seed base (T > 0)")
    p.add_argument("--json", default=None, help="write the JSON report here")
    p.add_argument("--markdown", default=None, help="write the markdown tables here")
    p.add_argument("--plots", default=None, help="write PNG figures into this directory")
    p.add_argument("--ecospec-global", action="store_true", help="ablation: EcoSpec global (static) expert cost")
    p.add_argument("--gamma-sweep", type=_csv(int), default=(), help="ablation: EcoSpec gamma values, e.g. 3,4,5,6")
    p.add_argument("--predictor-ablation", action="store_true", help="ablation: learned vs oracle expert predictor")
    p.add_argument("--rho-sweep", type=_csv(float), default=(), help="ablation: coverage rho values, e.g. 0.5,0.8,0.95")
    p.add_argument("--guard-ablation", type=_csv(str), default=(),
                   help="ablation: these cost-aware policies again without the speculate-or-not rule and the "
                        "drafting stop rule, e.g. evict,joint")
    p.add_argument("--values", default=None, help="node values of the cost-aware methods (evict, ecospec, "
                   "joint, coverage): calibrated, head, or raw (the ablation); default: the model's choice "
                   "(as `moespec generate`)")
    p.add_argument("--values-sweep", type=_csv(str), default=(), help="ablation: extra columns per cost-aware "
                   "method with these value models, e.g. raw,calibrated,head")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (as `moespec profile`; "
                   "0 = torch's default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return p


def resolve_methods(args) -> list[MethodSpec]:
    names = list(dict.fromkeys(args.methods))
    specs = [method_spec(n, args.predictor) for n in names]
    specs += ablation_specs(args.ecospec_global, tuple(args.gamma_sweep), args.predictor_ablation,
                            tuple(args.rho_sweep), args.predictor, tuple(args.guard_ablation))
    specs = values_specs([s for s in specs if s.label != "ar"], args.values, tuple(args.values_sweep))
    return [method_spec("ar")] + specs  # ar first: the reference of every prompt group


def _validate(args) -> None:
    for ds in args.datasets:
        if ds not in DATASETS:
            raise ValueError(f"unknown dataset {ds!r}; choose from {', '.join(DATASETS)}")
    if args.num_prompts < 1 or args.max_tokens < 1 or args.warmup_tokens < 1 or args.repeats < 1:
        raise ValueError("--num-prompts, --max-tokens, --warmup-tokens and --repeats must be positive")
    if not args.temperature or any(t < 0 for t in args.temperature):
        raise ValueError(f"temperatures must be >= 0, got {args.temperature}")
    if not args.datasets:
        raise ValueError("no datasets given")


def main(argv: list[str] | None = None, prog: str = "moespec bench") -> int:
    process_entry = argv is None  # `python -m benchmarks.run`: the process ends when this returns
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    from ..engine.config import TreeConfig
    from .report import build_report, machine_description, summary_lines

    try:
        from ..profiling import set_threads

        set_threads(args.threads)
        _validate(args)
        tree = TreeConfig.parse(args.tree) if args.tree is not None else None
        _check_output_paths(args)
        specs = resolve_methods(args)
        prompts = {ds: load_prompts(ds, args.num_prompts) for ds in args.datasets}
    except (ValueError, FileNotFoundError) as e:
        print(f"{prog}: error: {flag_message(str(e), build_parser(prog))}", file=sys.stderr)
        return 2
    started, machine = time.time(), machine_description(args.device)
    state, status, error, rc, runners = BenchState(), "complete", None, 0, []
    signals = RunSignals()  # Ctrl-C and SIGTERM end the run with a partial report; a second one is ignored
    try:
        runners = _build_runners(specs, args, tree)
        warm_up(runners, _warm_prompt(runners[0], args), args.warmup_tokens, tuple(args.temperature))
        total = len(args.temperature) * sum(len(v) for v in prompts.values()) * len(runners) * args.repeats
        from tqdm.auto import tqdm

        with tqdm(total=total, desc="bench (prompts x methods)", disable=args.no_progress) as bar:
            run_bench(runners, prompts, list(args.temperature), args.max_tokens, args.seed, state, bar, args.repeats)
    except (ValueError, FileNotFoundError) as e:
        signals.restore()
        print(f"{prog}: error: {flag_message(str(e), build_parser(prog))}", file=sys.stderr)
        return 2
    except LosslessMismatch as e:
        status, error, rc = "aborted", str(e), 3
        print(f"\n{prog}: {e}", file=sys.stderr)
    except KeyboardInterrupt as e:  # RunSignals ignores both signals from here on
        how = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted by the user (Ctrl-C)"
        status, error, rc = "interrupted", f"{how}; partial results", 143 if isinstance(e, Terminated) else 130
        print(f"\n{prog}: {how}; writing the partial report (further signals ignored)", file=sys.stderr)
    signals.ignore()  # the run is over: a signal now must not cut the report it writes (well under a second)
    config = _config(args, tree, specs, runners)
    report = build_report(status=status, error=error, command=prog.split() + argv, config=config, machine_start=machine,
                          state=state, analysis_only={s.label: s.analysis_only for s in specs}, started=started,
                          ended=time.time(), cost_profile=_profile_info(runners))
    if not _write_outputs(report, args, prog) and rc == 0:
        rc = 1  # the run finished, but a report is not where it was asked for (stderr says where it went)
    print("\n".join(summary_lines(report)))
    print(json.dumps({"status": report["status"], "results": [
        {k: r[k] for k in ("dataset", "method", "temperature", "tokens_per_s", "speedup_vs_ar", "mean_accepted_tokens")}
        for r in report["results"]]}))
    if not process_entry:  # called in-process (tests, scripts): give Ctrl-C and SIGTERM back
        signals.restore()
    return rc


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, as Python raises KeyboardInterrupt for Ctrl-C."""


class RunSignals:
    """Ctrl-C and SIGTERM during a run: the first raises KeyboardInterrupt (Terminated for SIGTERM) where
    the run is, and from that moment both are ignored, so a second one cannot cut the partial report
    short nor print a traceback from the unwinding. The handler ignores them before it raises: Python's
    own handler left a window, between the first exception and the `except` that ignored SIGINT, where
    a second Ctrl-C landed in a generator's clean-up. A signal the caller already ignores (or handles)
    is left alone; nothing is installed off the main thread, where Python cannot install handlers."""

    def __init__(self) -> None:
        self.previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
            if signal.getsignal(sig) is default:
                self.previous[sig] = signal.signal(sig, self._stop)

    def _stop(self, signum: int, frame) -> None:
        self.ignore()
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    def ignore(self) -> None:
        """Ignore the signals this object handles (the run is over, or stopping)."""
        for sig in self.previous:
            signal.signal(sig, signal.SIG_IGN)

    def restore(self) -> None:
        """Give back the handlers found at construction."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _build_runners(specs, args, tree):
    from tqdm.auto import tqdm

    runners = []
    for spec in tqdm(specs, desc="load methods", disable=args.no_progress):
        shared = runners[0].llm.target if runners else None  # one copy of the target's weights for every method
        runners.append(build_runner(spec, args.model, args.draft_model, tree, args.device, args.dtype, args.cost_profile,
                                    shared))
    return runners


def _warm_prompt(runner, args) -> list[int]:
    from .datasets import encode_prompt

    llm = runner.llm
    text = load_prompts(args.datasets[0], 1)[0].text
    return encode_prompt(text, llm.tokenizer, llm.target.vocab_size, llm.target.max_position_embeddings - args.warmup_tokens)


def _config(args, tree, specs, runners) -> dict:
    tok = tokenization_note(runners[0].llm.tokenizer) if runners else None
    tree = runners[0].llm.tree if runners else tree  # None given: the model's, which every method resolved alike
    values = {r.spec.label: r.llm.values_name for r in runners}  # as resolved (None given: the model's choice)
    return {"model": args.model, "draft_model": args.draft_model, "tree": list(tree.as_tuple()) if tree else None,
            "device": args.device,
            "dtype": args.dtype, "datasets": list(args.datasets), "temperatures": list(args.temperature),
            "num_prompts": args.num_prompts, "repeats": args.repeats, "max_tokens": args.max_tokens, "warmup_tokens": args.warmup_tokens,
            "seed": args.seed, "predictor": args.predictor, "tokenization": tok,
            "methods": [{"label": s.label, "policy": s.policy, "drafter": s.drafter, "policy_options": s.options,
                         "predictor": s.predictor, "analysis_only": s.analysis_only,
                         "values": values.get(s.label, s.values),
                         "llm_options": dict(s.llm_options)} for s in specs],
            "tuned_options": _tuned_options(specs, runners)}


def _tuned_options(specs, runners) -> dict:
    """label -> the options the model's policy_defaults.json gave a method (those its spec did not set)."""
    out = {}
    for s, r in zip(specs, runners):
        tuned = {k: v for k, v in r.llm.config.policy_options.items()
                 if k not in s.options and isinstance(v, (int, float, str, bool))}
        if tuned:
            out[s.label] = tuned
    return out


def _profile_info(runners) -> dict | None:
    """What cost profile evict/joint ran with (first one found)."""
    for r in runners:
        table = getattr(r.llm.policy, "cost_table", None)
        if table is not None:
            return {"model_id": table.model_id, "device": table.device, "dtype": table.dtype,
                    "tree": list(table.tree) if table.tree else None, "method": table.method, "date": table.date,
                    "costs_ms": [c * 1e3 for c in table.costs]}
    return None


def _check_output_paths(args) -> None:
    """Refuse output paths that could only fail after the whole run: a directory where a file goes or the
    reverse, a parent that is a file, a folder this process cannot create files in."""
    from ..outfiles import check_writable

    for flag, value, want_dir in (("--json", args.json, False), ("--markdown", args.markdown, False),
                                  ("--plots", args.plots, True)):
        if value is not None:
            check_writable(value, flag, want_dir)


def _write_outputs(report: dict, args, prog: str) -> bool:
    """Write the requested outputs atomically; an incomplete report goes beside any existing file
    (NAME.partial.EXT) instead of replacing it. A write that fails goes elsewhere (outfiles.save_report);
    returns whether every output went where it was asked."""
    from ..outfiles import save_report
    from .report import markdown, partial_path

    incomplete, where_asked = report["status"] != "complete", True
    for flag, value, text in (("--json", args.json, lambda: json.dumps(report, indent=1) + "\n"),
                              ("--markdown", args.markdown, lambda: markdown(report))):
        if value:
            path = partial_path(value) if incomplete else Path(value)
            where_asked &= save_report(path, text(), flag, prog) == path
            if path != Path(value):
                print(f"{flag}: {value} exists and is kept; the {report['status']} report went to {path}",
                      file=sys.stderr)
    if args.plots:
        plots = Path(args.plots)
        if incomplete and plots.is_dir() and any(plots.iterdir()):
            plots = plots.with_name(plots.name + ".partial")
        where_asked &= _write_plots(report, plots, prog)
    return where_asked


def _write_plots(report: dict, plots: Path, prog: str) -> bool:
    """The figures into `plots`, else into a temporary directory (said on stderr); True when in `plots`."""
    import tempfile

    from .plots import write_plots

    try:
        write_plots(report, plots)
        return True
    except OSError as e:
        fallback = Path(tempfile.mkdtemp(prefix=f"{plots.name}."))
        print(f"{prog}: error: cannot write --plots {plots} ({e.strerror or e}); the figures went to {fallback}",
              file=sys.stderr)
        write_plots(report, fallback)
        return False
