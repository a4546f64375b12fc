"""Per-request traces of the speculate-or-not rules: which steps a cost-aware policy speculates, and what
each speculative step commits, under the default rules and with the goodput guard and/or the drafting
stop rule switched off (the variants share one target and run interleaved per prompt).

One line per (prompt, variant): tokens/s, speculative steps, mean speculative and plain step time, then
the step trace: a digit = tokens a speculative step committed (9 = 9 or more), `.` = a plain step.
This is how the drafting stop rule's trap was found (2026-12-02, moespec-base, evict, T=0, 4 prompts
per data set, 96 tokens: defaults 62 tok/s, guard only 83, both off 83; the stop rule held speculative
steps at ~2 tokens where the full tree commits 4-5).

    python -m benchmarks.guard_trace [--model moespec-base] [--policy evict] [--prompts 4] [--tokens 96]
    python -m benchmarks.guard_trace --variants default,guard:weight=0.1,guard:probe_every=4   # GuardConfig fields
"""

from __future__ import annotations

import argparse

import torch

# (label, LLM keywords): the defaults, and each rule switched on or off against them
VARIANTS = {
    "default": {},
    "off": dict(guard="off", draft_stop=False),
    "stop-only": dict(guard="off", draft_stop=True),
    "guard-only": dict(draft_stop=False),
    "guard+stop": dict(draft_stop=True),
}


def guard_variant(label: str) -> dict[str, float]:
    """`guard:field=value;field=value` -> GuardConfig overrides of the default guard (ValueError otherwise)."""
    from dataclasses import fields

    from trtllm_moespec.engine.guard import GuardConfig

    known = {f.name: f.type for f in fields(GuardConfig)}
    overrides = {}
    for item in label.removeprefix("guard:").split(";"):
        key, _, value = item.partition("=")
        if key not in known or not value:
            raise ValueError(f"variant {label!r}: {item!r} is not field=value of GuardConfig ({', '.join(known)})")
        kind = known[key]
        overrides[key] = (int(value) if kind in ("int", int) else bool(int(value)) if kind in ("bool", bool)
                          else float(value))
    return overrides


def make_llm(name: str, policy: str, **kwargs):
    """The LLM of a variant: one of VARIANTS, or the default guard with GuardConfig overrides."""
    from dataclasses import replace

    from trtllm_moespec import LLM
    from trtllm_moespec.engine.guard import Guard

    if not name.startswith("guard:"):
        return LLM(policy=policy, **kwargs, **VARIANTS[name])
    overrides = guard_variant(name)
    llm = LLM(policy=policy, **kwargs)
    g = llm.engine.guard
    llm.engine.guard = Guard(replace(g.config, **overrides), g.cost_table, g.plain_step_s)
    return llm


def trace(steps) -> str:
    """A digit per speculative step (its committed tokens, capped at 9), `.` per plain step."""
    return "".join(str(min(s.committed_tokens, 9)) if s.speculated else "." for s in steps)


def main(argv=None) -> dict[str, float]:
    from trtllm_moespec import SamplingParams
    from trtllm_moespec.bench.datasets import encode_prompt, load_prompts
    from trtllm_moespec.bench.methods import MethodRunner, MethodSpec

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moespec-base")
    ap.add_argument("--policy", default="evict", choices=("evict", "ecospec", "joint", "coverage"))
    ap.add_argument("--variants", default="default,off,stop-only",
                    help=f"comma list of {', '.join(VARIANTS)} or guard:field=value;... (GuardConfig overrides)")
    ap.add_argument("--datasets", default="humaneval,mt_bench,gsm8k")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per data set")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    runners, target = {}, None
    for name in args.variants.split(","):
        llm = make_llm(name, args.policy, model=args.model, target_model=target, threads=None)
        target = llm.target
        runners[name] = MethodRunner(MethodSpec(name, args.policy), llm)
    first = next(iter(runners.values())).llm
    limit = first.target.max_position_embeddings - args.tokens
    prompts = [(ds, encode_prompt(p.text, first.tokenizer, first.target.vocab_size, limit))
               for ds in args.datasets.split(",") for p in load_prompts(ds, args.prompts)]
    params = SamplingParams(max_tokens=args.tokens, temperature=args.temperature, seed=0)
    for r in runners.values():  # warm-up: one-time costs and the guard's first measurements
        r.generate(prompts[0][1][:48], params)
    totals = {name: [0, 0.0] for name in runners}
    for ds, ids in prompts:
        for name, r in runners.items():
            g = r.generate(ids, params)
            seconds = g.stats.decode_s + g.stats.prefill_ms / 1e3
            totals[name][0] += len(g.token_ids)
            totals[name][1] += seconds
            spec = [s.step_ms for s in g.steps if s.speculated]
            plain = [s.step_ms for s in g.steps if not s.speculated]
            mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
            print(f"{ds:9s} {name:16s} {len(g.token_ids) / seconds:6.1f} tok/s  spec {len(spec):3d}/{len(g.steps):3d}"
                  f"  spec {mean(spec):5.1f} ms  plain {mean(plain):5.1f} ms  {trace(g.steps)}", flush=True)
    rates = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
    for name, rate in rates.items():
        print(f"{name}: {rate:.1f} tok/s over all prompts")
    return rates


if __name__ == "__main__":
    main()
