"""The benchmark loop: warm-up, then methods interleaved per prompt, with the T=0 losslessness check.

For each temperature, dataset and prompt, every method runs once per round, the rounds
alternating between one order and its reverse (A B C, C B A, A B C, ...), so machine drift
hits all methods alike and no method always runs right after the same one. At temperature 0
every method's tokens must equal `ar`'s token for token; a mismatch raises
`LosslessMismatch` (the caller writes a partial report and exits non-zero).
At temperature > 0 every method gets the same per-prompt seed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..engine.stats import GenerationStats
from .datasets import Prompt, encode_prompt
from .methods import Generation, MethodRunner

Key = tuple[str, str, float]  # (dataset, method label, temperature)


class LosslessMismatch(RuntimeError):
    """A method's greedy output differs from plain decoding."""


@dataclass
class BenchState:
    """Everything measured so far (valid to report at any point)."""

    stats: dict[Key, list[GenerationStats]] = field(default_factory=lambda: defaultdict(list))
    steps: dict[Key, dict[str, list[float]]] = field(default_factory=dict)  # columnar per-step records
    prompt_tokens: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # per dataset
    completed_prompts: int = 0

    def add(self, key: Key, gen: Generation) -> None:
        self.stats[key].append(gen.stats)
        cols = self.steps.setdefault(key, {n: [] for n in STEP_FIELDS})
        for s in gen.steps:
            for n in STEP_FIELDS:
                cols[n].append(round(float(getattr(s, n)), 4))


STEP_FIELDS = ("verified_tokens", "committed_tokens", "unique_experts_per_layer", "step_ms", "verify_ms", "draft_ms",
               "select_ms", "predictor_ms", "speculated")


def median_run(gens: list[Generation]) -> Generation:
    """The run of median wall time (prefill + decode) among repeats of one prompt and method."""
    order = sorted(gens, key=lambda g: g.stats.decode_s + g.stats.prefill_ms / 1e3)
    return order[(len(order) - 1) // 2]


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_lossless(label: str, prompt: Prompt, tokens: list[int], reference: list[int]) -> None:
    i = first_mismatch(tokens, reference)
    if i is not None:
        raise LosslessMismatch(
            f"T=0 MISMATCH: method {label!r} on {prompt.dataset} prompt {prompt.prompt_id!r} produced different tokens "
            f"than 'ar' at output position {i} (method: {tokens[i:i + 8]}, ar: {reference[i:i + 8]}; lengths "
            f"{len(tokens)} vs {len(reference)}). Greedy speculative decoding must be lossless; aborting.")


def warm_up(runners: list[MethodRunner], prompt_ids: list[int], max_tokens: int,
            temperatures: tuple[float, ...] = (0.0,)) -> None:
    """One short untimed generation per method and temperature: one-time costs (allocator, kernels,
    caches, and the goodput guard's first measurements, which an engine keeps per kind of sampling
    and a server pays once) stay out of the first timed prompt group of each temperature."""
    from ..api import SamplingParams

    for temperature in temperatures:
        for r in runners:
            r.generate(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0))


def run_bench(runners: list[MethodRunner], prompts: dict[str, list[Prompt]], temperatures: list[float], max_tokens: int,
              seed: int, state: BenchState, progress=None, repeats: int = 1) -> BenchState:
    """Fill `state` prompt group by prompt group; raises LosslessMismatch, lets KeyboardInterrupt
    through (state then holds the completed groups). With `repeats` > 1 every method runs each
    prompt that many times, the methods interleaved within each round (every other round in reverse
    order), and the run of median
    wall time is kept (same tokens every time: greedy, or the prompt's fixed seed), so a burst of
    machine noise during one run does not decide a cell."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    from ..api import SamplingParams

    if runners[0].spec.label != "ar":
        raise ValueError("the first method must be 'ar' (the reference for speedups and the T=0 check)")
    llm = runners[0].llm
    limit = llm.target.max_position_embeddings - max_tokens
    encoded = {ds: [encode_prompt(p.text, llm.tokenizer, llm.target.vocab_size, limit) for p in ps]
               for ds, ps in prompts.items()}
    for ds, ids in encoded.items():
        state.prompt_tokens[ds] = [len(x) for x in ids]
    for temperature in temperatures:
        for ds, ps in prompts.items():
            for i, prompt in enumerate(ps):
                params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                        seed=None if temperature == 0 else seed + i)
                reference, runs = None, {r.spec.label: [] for r in runners}
                for rep in range(repeats):
                    # every other round in reverse order: a method's place in the round (what ran just
                    # before it) is no lasting advantage; round 0 runs 'ar' first, for the T=0 reference
                    for r in runners if rep % 2 == 0 else runners[::-1]:
                        if progress is not None:
                            progress.set_postfix_str(f"T={temperature:g} {ds}#{prompt.prompt_id} {r.spec.label}")
                        gen = r.generate(encoded[ds][i], params)
                        if temperature == 0:
                            if reference is None:
                                reference = gen.token_ids
                            else:
                                check_lossless(r.spec.label, prompt, gen.token_ids, reference)
                        runs[r.spec.label].append(gen)
                        if progress is not None:
                            progress.update(1)
                for label, gens in runs.items():  # whole groups only: every method always covers the same prompts
                    state.add((ds, label, float(temperature)), median_run(gens))
                state.completed_prompts += 1
    return state
