"""Serving benchmark: throughput, TTFT and inter-token latency at several concurrencies.

Each (method, c) has its own engine, warmed up by a short load first (steady state of a
long-running server). For each concurrency c, c closed-loop clients keep the scheduler busy (each sends its next
prompt when the last one finished; `--requests-per-client` each) through the same
`Scheduler` the HTTP server runs, with `--max-batch-size c`; methods are interleaved per
repeat so machine drift hits them alike. T=0, `ignore_eos`, fixed new tokens, so every
method produces the same tokens (checked: the run aborts otherwise).

Per (method, c): tokens/s over the wall time of the whole load, TTFT (submit -> first
token) p50/p99, inter-token latency p50/p99 (gaps between successive token deliveries of
one request, a delivery carrying every token one step committed), Mat, batch size.

    python -m benchmarks.bench_serve --methods ar,eagle3,ecospec,joint,joint-batch,evict-batch,ecospec-batch \\
        --concurrency 1,2,4,8 \\
        [--engine batched|round-robin] [--tokens 32] [--repeats 2] [--json PATH] [--md PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.bench.datasets import load_prompts
from trtllm_moespec.serve.scheduler import FinishEvent, Scheduler, TokenEvent
from trtllm_moespec.serve.server import make_engine


@dataclass
class _Trace:
    """Delivery times of one request."""

    submitted: float
    deliveries: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens)
    finish: FinishEvent | None = None
    done: threading.Event = field(default_factory=threading.Event)
    request: object = None

    def __call__(self, event) -> None:
        if isinstance(event, TokenEvent):
            self.deliveries.append((time.perf_counter(), len(event.token_ids)))
        else:
            self.finish = event
            self.done.set()


def run_load(llm: LLM, engine, prompts: list[list[int]], concurrency: int, per_client: int,
             params: SamplingParams) -> tuple[list[_Trace], float, Scheduler]:
    """c closed-loop clients, each sending `per_client` prompts one after another."""
    scheduler = Scheduler(engine, max_queue=concurrency)
    scheduler.start()
    traces: list[_Trace] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for j in range(per_client):
            ids = prompts[(k * per_client + j) % len(prompts)]
            request = llm.make_request(ids, params)
            trace = _Trace(time.perf_counter(), request=request)
            scheduler.submit(request, trace)
            if not trace.done.wait(600):
                raise RuntimeError("a request did not finish within 600 s")
            with lock:
                traces.append(trace)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    scheduler.stop()
    return traces, wall, scheduler


def summarize(traces: list[_Trace], wall: float, scheduler: Scheduler) -> dict:
    tokens = sum(len(t.request.output_ids) for t in traces)
    ttft = [t.deliveries[0][0] - t.submitted for t in traces]
    itl = [b[0] - a[0] for t in traces for a, b in zip(t.deliveries, t.deliveries[1:])]
    m = scheduler.metrics
    return {
        "tokens_per_s": tokens / wall, "num_tokens": tokens, "wall_s": wall, "num_requests": len(traces),
        "ttft_ms_p50": 1e3 * float(np.percentile(ttft, 50)), "ttft_ms_p99": 1e3 * float(np.percentile(ttft, 99)),
        "itl_ms_p50": 1e3 * float(np.percentile(itl, 50)) if itl else 0.0,
        "itl_ms_p99": 1e3 * float(np.percentile(itl, 99)) if itl else 0.0,
        "mean_accepted_tokens": m.committed / max(m.iterations, 1),
        "verified_tokens": m.verified / max(m.iterations, 1),
        "unique_experts_per_layer": m.unique_experts_sum / max(m.verify_steps, 1),
        "mean_batch_size": m.batch_size_sum / max(m.engine_steps, 1),
    }


def _median_runs(runs: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in runs])) for k in runs[0]}


def markdown(results: dict, methods: list[str], conc: list[int]) -> str:
    base = {c: results["ar"][str(c)]["tokens_per_s"] for c in conc} if "ar" in results else None
    lines = ["| method | c | tokens/s | x ar | TTFT p50 / p99 ms | ITL p50 / p99 ms | Mat | batch |",
             "|---|---|---|---|---|---|---|---|"]
    for m in methods:
        for c in conc:
            r = results[m][str(c)]
            ratio = f"{r['tokens_per_s'] / base[c]:.2f}x" if base else "-"
            lines.append(f"| {m} | {c} | {r['tokens_per_s']:.1f} | {ratio} | {r['ttft_ms_p50']:.0f} / "
                         f"{r['ttft_ms_p99']:.0f} | {r['itl_ms_p50']:.1f} / {r['itl_ms_p99']:.1f} | "
                         f"{r['mean_accepted_tokens']:.2f} | {r['mean_batch_size']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, methods: list[str], conc: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for m in methods:
        rows = [results[m][str(c)] for c in conc]
        axes[0].plot(conc, [r["tokens_per_s"] for r in rows], marker="o", label=m)
        axes[1].plot(conc, [r["ttft_ms_p50"] for r in rows], marker="o", label=m)
        axes[2].plot(conc, [r["itl_ms_p50"] for r in rows], marker="o", label=m)
    for ax, title in zip(axes, ("throughput (tokens/s)", "TTFT p50 (ms)", "inter-token p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.set_xlabel("concurrency (= max batch size)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moespec-tiny")
    ap.add_argument("--methods", default="ar,eagle3,ecospec,joint,joint-batch,evict-batch,ecospec-batch",
                    help="policies; X-batch = policy X's nodes chosen across the batch (always the batched engine)")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--engine", default="batched", help="batched or round-robin (the X-batch methods are always batched)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup-tokens", type=int, default=16, help="new tokens per request of the warm-up load")
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    methods, conc = args.methods.split(","), [int(c) for c in args.concurrency.split(",")]
    llms = {m: LLM(args.model, policy=m.removesuffix("-batch")) for m in methods}
    tok = next(iter(llms.values()))
    prompts = [tok.encode(p.text)[0][-96:] for p in load_prompts(args.dataset, max(conc) * args.requests_per_client)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    runs: dict[str, dict[int, list[dict]]] = {m: {c: [] for c in conc} for m in methods}
    reference: dict[int, list[list[int]]] = {}
    # One engine per (method, c), warmed up by a short load of its own before any measurement: a
    # server runs for long, so what it learns online (joint-batch's per-batch-size costs and goodput
    # guard, the value calibration) is measured in its steady state, for every method alike.
    engines = {(m, c): make_engine(llms[m], c, _engine_kind(m, args.engine)) for m in methods for c in conc}
    warm = SamplingParams(max_tokens=args.warmup_tokens, temperature=0.0, ignore_eos=True)
    for (m, c), engine in engines.items():
        run_load(llms[m], engine, prompts[::-1], c, 1, warm)
    for rep in range(args.repeats):
        for c in conc:
            for m in methods:
                traces, wall, scheduler = run_load(llms[m], engines[m, c], prompts, c, args.requests_per_client,
                                                   params)
                outputs = sorted((list(t.request.prompt_ids), list(t.request.output_ids)) for t in traces)
                if reference.setdefault(c, outputs) != outputs:
                    raise SystemExit(f"{m} at concurrency {c} produced different tokens than {methods[0]}")
                runs[m][c].append(summarize(traces, wall, scheduler))
                print(f"rep {rep} c={c} {m}: {runs[m][c][-1]['tokens_per_s']:.1f} tok/s", flush=True)
    results = {m: {str(c): _median_runs(runs[m][c]) for c in conc} for m in methods}
    report = {"command": "python -m benchmarks.bench_serve " + " ".join(sys.argv[1:] if argv is None else argv), "engine": args.engine,
              "model": args.model, "tokens": args.tokens, "requests_per_client": args.requests_per_client,
              "repeats": args.repeats, "dataset": args.dataset, "machine": platform.processor() or platform.machine(),
              "load_average": os.getloadavg(), "results": results}
    table = markdown(results, methods, conc)
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(f"Command: `{report['command']}` (engine {args.engine}, load average "
                    f"{report['load_average'][0]:.1f} at the end)\n\n{table}")
    if args.plot:
        plot(results, methods, conc, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report))
    return report


def _engine_kind(method: str, engine: str) -> str:
    return method if method.endswith("-batch") else engine


if __name__ == "__main__":
    main()
