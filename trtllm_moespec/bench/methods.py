"""The benchmarked methods: how each maps onto `LLM(...)`, plus the papers' ablations.

Every EAGLE-family method uses the same drafter weights and tree config; they
differ only in the selection policy (and `lookahead` swaps in the n-gram drafter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.engine import Request
from ..engine.stats import GenerationStats, StepStats

BASE_METHODS = ("ar", "lookahead", "eagle3", "ddd", "coverage", "evict", "ecospec", "joint", "oracle")
DEFAULT_METHODS = BASE_METHODS


@dataclass(frozen=True)
class MethodSpec:
    """One column of the benchmark."""

    label: str  # name in reports, e.g. "ecospec[gamma=5]"
    policy: str  # LLM policy
    drafter: str = "eagle3"
    policy_options: tuple[tuple[str, object], ...] = ()  # sorted (key, value) pairs
    predictor: str | None = None  # None = the model's own predictor; "oracle" = true routing (analysis)
    analysis_only: bool = False  # an upper bound, not a deployable method (its step runs extra target forwards)
    values: str | None = None  # node values of the cost-aware policies (core/values.py); None: the model's choice
    llm_options: tuple[tuple[str, object], ...] = ()  # extra LLM(...) keywords, e.g. (("guard", "off"),)

    @property
    def options(self) -> dict:
        return dict(self.policy_options)


def method_spec(name: str, predictor: str | None = None) -> MethodSpec:
    """The spec of a base method; `predictor` applies to the expert-aware ones (ecospec, joint)."""
    if name not in BASE_METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(BASE_METHODS)}")
    if name == "lookahead":
        return MethodSpec("lookahead", "eagle3", drafter="ngram")
    if name in ("ecospec", "joint"):
        return MethodSpec(name, name, predictor=predictor)
    return MethodSpec(name, name, analysis_only=name == "oracle")


def ablation_specs(ecospec_global: bool = False, gamma_sweep: tuple[int, ...] = (), predictor_ablation: bool = False,
                   rho_sweep: tuple[float, ...] = (), predictor: str | None = None,
                 guard_ablation: tuple[str, ...] = ()) -> list[MethodSpec]:
    """Extra columns for the papers' ablations.

    gamma counts the bonus token (EcoSpec's convention), so the node budget is gamma - 1.
    """
    specs = []
    if ecospec_global:
        specs.append(MethodSpec("ecospec[global]", "ecospec", policy_options=(("global_cost", True),), predictor=predictor))
    for gamma in gamma_sweep:
        if gamma < 2:
            raise ValueError(f"gamma must be >= 2 (it counts the bonus token), got {gamma}")
        specs.append(MethodSpec(f"ecospec[gamma={gamma}]", "ecospec", policy_options=(("budget", gamma - 1),),
                                predictor=predictor))
    if predictor_ablation:
        for name in ("ecospec", "joint"):
            specs.append(MethodSpec(f"{name}[predictor=oracle]", name, predictor="oracle", analysis_only=True))
    for rho in rho_sweep:
        if not 0 < rho <= 1:
            raise ValueError(f"rho must lie in (0, 1], got {rho}")
        specs.append(MethodSpec(f"coverage[rho={rho:g}]", "coverage", policy_options=(("rho", float(rho)),)))
    for name in guard_ablation:  # the cost-aware policy without the speculate-or-not rule and the drafting stop rule
        if name not in ("ddd", "coverage", "evict", "ecospec", "joint"):
            raise ValueError(f"--guard-ablation takes cost-aware policies (ddd, coverage, evict, ecospec, joint), got {name!r}")
        base = method_spec(name, predictor)
        specs.append(MethodSpec(f"{name}[guard=off,stop=off]", base.policy, predictor=base.predictor,
                                llm_options=(("draft_stop", False), ("guard", "off"))))
    return specs


@dataclass(frozen=True)
class Generation:
    """One request's output with its per-step records."""

    token_ids: list[int]
    stats: GenerationStats
    steps: list[StepStats] = field(repr=False)


class MethodRunner:
    """A method's LLM (built once) and a generate call that keeps the per-step records."""

    def __init__(self, spec: MethodSpec, llm):
        self.spec, self.llm = spec, llm

    def generate(self, prompt_ids: list[int], params) -> Generation:
        request: Request = self.llm.make_request(prompt_ids, params)
        for _ in self.llm.engine.run(request):
            pass
        return Generation(list(request.output_ids), request.stats(), list(request.steps))


VALUE_POLICIES = ("evict", "ecospec", "joint", "coverage")  # the policies that rank on node values


def values_specs(specs: list[MethodSpec], default: str | None, sweep: tuple[str, ...] = ()) -> list[MethodSpec]:
    """Apply the default value model to the cost-aware methods (None: the model's choice, as `LLM`), and add
    one column per swept value model (label `joint[values=raw]`) for each cost-aware base method."""
    from dataclasses import replace

    from ..core.values import VALUE_KINDS

    for v in (default, *sweep):
        if v is not None and v not in VALUE_KINDS:
            raise ValueError(f"unknown values {v!r}; choose from {', '.join(VALUE_KINDS)}")
    out = [replace(s, values=default) if s.policy in VALUE_POLICIES else s for s in specs]
    for s in specs:
        if s.policy in VALUE_POLICIES and s.label == s.policy:
            out += [replace(s, label=f"{s.label}[values={v}]", values=v) for v in sweep if v != default]
    return out


def build_runner(spec: MethodSpec, model: str, draft_model: str | None, tree, device: str, dtype: str,
                 cost_profile: str | None = None, target_model=None) -> MethodRunner:
    """A method's LLM; `target_model` (the first method's target) is shared, so every method runs on one copy
    of the weights: separate copies' placement in memory alone moved a plain step by a few percent."""
    from ..api import LLM

    llm = LLM(model=model, draft_model=draft_model, policy=spec.policy, tree=tree, device=device, dtype=dtype,
              cost_profile=cost_profile if spec.policy in ("evict", "joint") else None, predictor=spec.predictor, drafter=spec.drafter,
              policy_options=spec.options or None, values=spec.values, threads=None,  # bench set --threads
              target_model=target_model, **dict(spec.llm_options))
    return MethodRunner(spec, llm)
