"""The compiled CPU experts kernel (models/experts_host.py) beside the torch paths it replaces, side by side.

Two measurements, each alternating kernel on / off (MOESPEC_HOST_EXPERTS, read at every call) round by round,
one torch thread, medians:
- the routed experts of every MoE layer once (as a forward streams them) for N tokens of random hidden states,
  routed by each layer's own router;
- the target's whole forward over N new tokens after a 100-token prefix (a plain step at N = 1, a chain-masked
  verify above), the cost `moespec profile` fits.

    python -m benchmarks.bench_experts_kernel [--model moespec-base] [--rounds 40] [--json PATH] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from tqdm import tqdm

SIZES = (1, 2, 3, 5, 9, 17, 33)
PREFIX = 100


def _switch(on: bool) -> None:
    os.environ["MOESPEC_HOST_EXPERTS"] = "1" if on else "0"


def _alternated(fn_of_size, sizes, rounds: int, desc: str) -> dict[int, dict[str, float]]:
    """{N: {"on": median ms, "off": median ms}}: fn_of_size(N)() timed with the kernel on and off, the
    order flipping every round."""
    times = {n: {"on": [], "off": []} for n in sizes}
    for r in tqdm(range(rounds + 2), desc=desc):
        for n in sizes:
            run = fn_of_size(n)
            for on in ((True, False) if r % 2 else (False, True)):
                _switch(on)
                start = time.perf_counter()
                run()
                if r >= 2:  # two warm-up rounds (the kernel compiles or loads from its cache in the first)
                    times[n]["on" if on else "off"].append((time.perf_counter() - start) * 1e3)
    _switch(True)
    return {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}


def measure(model: str, rounds: int) -> dict:
    from trtllm_moespec import LLM
    from trtllm_moespec.models.lean_forward import ForwardBatch
    from trtllm_moespec.models.moe import route, routed_experts

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    lean = LLM(model, policy="ar").target.lean
    moe_layers = [layer for layer in lean.layers if layer.router is not None]
    hidden = lean.embed.shape[1]
    gen = torch.Generator().manual_seed(0)

    def experts_of(n: int):
        x = torch.randn(n, hidden, generator=gen)
        routed = [(layer.experts, *route(x, layer.router)) for layer in moe_layers]
        return lambda: [routed_experts(x, ids, w, experts) for experts, ids, w in routed]

    cache = lean.new_cache(PREFIX + max(SIZES) + 1)
    lean.forward(cache, ForwardBatch(torch.randint(0, lean.embed.shape[0], (1, PREFIX), generator=gen),
                                     torch.arange(PREFIX)[None], (0,), (0,), None, 1))

    def forward_of(n: int):
        ids = torch.randint(0, lean.embed.shape[0], (1, n), generator=gen)
        mask = torch.tril(torch.ones(n, n, dtype=torch.bool))[None] if n > 1 else None
        batch = ForwardBatch(ids, torch.arange(PREFIX, PREFIX + n)[None], (0,), (PREFIX,), mask, 0)
        return lambda: lean.forward(cache, batch)  # writes the same cache slots each time: no growth

    return {"model": model, "rounds": rounds, "moe_layers": len(moe_layers),
            "experts_ms": _alternated(experts_of, SIZES, rounds, "experts"),
            "forward_ms": _alternated(forward_of, SIZES, rounds, "forward")}


def markdown(result: dict, command: str) -> str:
    lines = [f"# The CPU experts kernel beside the torch paths ({result['model']})", "", f"`{command}`", "",
             f"Medians of {result['rounds']} alternated rounds, 1 torch thread, ms. Experts: all "
             f"{result['moe_layers']} MoE layers' routed experts once; forward: the target over N new tokens "
             f"after a {PREFIX}-token prefix.", "",
             "| N tokens | experts, kernel | experts, torch | x | forward, kernel | forward, torch | x |",
             "|---|---|---|---|---|---|---|"]
    for n in SIZES:
        e, f = result["experts_ms"][n], result["forward_ms"][n]
        lines.append(f"| {n} | {e['on']:.2f} | {e['off']:.2f} | {e['off'] / e['on']:.2f} | {f['on']:.2f} | "
                     f"{f['off']:.2f} | {f['off'] / f['on']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moespec-base")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    result = measure(args.model, args.rounds)
    command = "python -m benchmarks.bench_experts_kernel " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if v is not None and k != "json" and k != "markdown")
    text = markdown(result, command)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
