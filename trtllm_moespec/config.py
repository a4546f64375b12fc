"""What a user asks `LLM` for, and what that resolves to.

- `MoESpecConfig`: how to speculate, passed as `LLM(model, speculative_config=MoESpecConfig(...))`
  in the shape of TensorRT-LLM's `speculative_config=` (its `EagleDecodingConfig` names the draft
  model and the tree; ours also names the selection policy, the node values and the guard).
  The same fields are accepted as flat `LLM(...)` keywords.
- `RuntimeConfig`: where and how the target runs (device, dtype, forward, threads, graphs, prefix cache).
- `ResolvedConfig`: both, with every default decided and every named file checked and loaded
  (`resolve.resolve_config` builds it, before any weights load); `assemble.py` builds the engine
  from it, so nothing after resolution chooses a default again.

All three are frozen and validated on construction, with errors that name the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .core.cost import CostTable
from .core.policies import POLICIES
from .core.values import VALUE_KINDS
from .engine.config import TreeConfig

if TYPE_CHECKING:
    import torch

    from .engine.guard import SampledPrior
    from .resolve import ModelPaths

METHODS = tuple(sorted(set(POLICIES) | {"ddd"}))  # the policies LLM(policy=...) accepts
COST_AWARE = ("evict", "ecospec", "joint", "coverage", "ddd")  # policies that get the drafting rules by default
GUARD_MODES = ("auto", "measured", "profiled", "off")
DRAFTERS = ("eagle3", "ngram")
MODEL_IMPLS = ("lean", "hf")  # = models.target.MODEL_IMPLS (kept here so that this module needs no transformers)
TINY = "moespec-tiny"  # the shipped model the tests run on


@dataclass(frozen=True)
class MoESpecConfig:
    """How to speculate (LLM's `speculative_config=`). Every field has the default `LLM` has."""

    policy: str = "joint"  # which draft nodes to verify each step (config.METHODS)
    # drafting shape and the verification cap; None: the model's, the tree its cost profile was measured with
    # (moespec-base 6,8,32, moespec-tiny 4,8,32; EAGLE's 4,8,32 where no profile names one)
    tree: TreeConfig | None = None
    draft_model: str | Path | None = None  # EAGLE-3 drafter directory; None: the model's own
    drafter: str = "eagle3"  # "eagle3", or "ngram" (weightless prompt lookup)
    # node values of the cost-aware policies: "raw", "calibrated", "head"; None: the model's choice for its tree and
    # device (policy_defaults.json: moespec-base "head" on CPU), else "calibrated"
    values: str | None = None
    guard: str = "auto"  # speculate-or-not rule: "auto", "measured", "profiled", "off"
    draft_stop: bool | None = None  # stop drafting when another forward cannot pay; None: auto
    cost_profile: str | Path | CostTable | None = None  # path, "roofline:<device>", a CostTable; None: the model's
    override_profile: bool = False  # use a profile made for another model / device / dtype / tree
    predictor: str | Path | None = None  # expert predictor directory or "oracle"; None: the model's own
    policy_options: dict[str, Any] | None = None  # extra keywords of the policy (e.g. {"budget": 16})
    ddd_threshold: float | None = None  # ddd's frontier-score threshold; None: 0.3 for ddd, off otherwise
    ep_pricing: bool = True  # with expert parallelism, ecospec / joint price the busiest rank's experts

    def __post_init__(self) -> None:
        if self.policy not in METHODS:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(METHODS)}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be 'eagle3' or 'ngram', got {self.drafter!r}")
        if self.tree is not None and not isinstance(self.tree, TreeConfig):
            raise ValueError(f"tree must be a TreeConfig or None, got {type(self.tree).__name__}")
        if self.guard not in GUARD_MODES:
            raise ValueError(f"guard must be one of {', '.join(GUARD_MODES)}, got {self.guard!r}")
        if self.draft_stop not in (None, True, False):
            raise ValueError(f"draft_stop must be None (auto), True or False, got {self.draft_stop!r}")
        if self.values is not None and self.values not in VALUE_KINDS:
            raise ValueError(f"unknown values {self.values!r}; choose one of {', '.join(VALUE_KINDS)}")
        for name in ("override_profile", "ep_pricing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {describe(getattr(self, name))}")
        _check_paths(draft_model=self.draft_model, cost_profile=self.cost_profile, predictor=self.predictor)
        t = self.ddd_threshold
        if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool)):
            raise ValueError(f"ddd_threshold must be a number or None, got {describe(t)}")
        if self.policy_options is not None and not isinstance(self.policy_options, dict):
            raise ValueError(f"policy_options must be a dict or None, got {describe(self.policy_options)}")
        if self.policy_options is not None:  # a copy: the caller's dict changing later must not change this config
            object.__setattr__(self, "policy_options", dict(self.policy_options))

    @classmethod
    def from_keywords(cls, given: dict[str, Any]) -> "MoESpecConfig":
        """The config of flat `LLM(...)` keywords (`given`: the names of this class's fields only)."""
        return cls(**given)

    def explicit(self) -> dict[str, Any]:
        """The fields that differ from their defaults (for messages and reports)."""
        default = MoESpecConfig()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}


SPEC_FIELDS = tuple(f.name for f in fields(MoESpecConfig))


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how the target runs (the non-speculative `LLM(...)` keywords)."""

    model: str | Path  # a local Hugging Face directory or a shipped model's name
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    dtype: str = "float32"
    model_impl: str = "lean"  # "lean" (our forward, static KV cache) or "hf" (transformers', the reference)
    threads: int | None = 1  # torch intra-op threads on CPU; None leaves torch's setting alone
    cuda_graphs: bool | None = None  # replay the verify forward from CUDA graphs; None: on for CUDA + lean
    prefix_cache: int = 0  # finished prompts whose K/V is kept for later prompts (0 = off)

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, Path)):
            raise ValueError(f"model must be a path or '{TINY}', got {describe(self.model)}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {self.model_impl!r}")
        if self.cuda_graphs not in (None, True, False):
            raise ValueError(f"cuda_graphs must be None (auto), True or False, got {self.cuda_graphs!r}")
        if not is_int(self.prefix_cache) or self.prefix_cache < 0:
            raise ValueError(f"prefix_cache must be an integer >= 0 (kept prompts; 0 = off), got {self.prefix_cache!r}")


@dataclass(frozen=True)
class ResolvedConfig:
    """Everything `assemble.py` needs to build the engine, each default decided (see module docstring)."""

    spec: MoESpecConfig  # as the user gave it (validated)
    runtime: RuntimeConfig  # as the user gave it (validated)
    paths: "ModelPaths"  # checked local paths; `predictor` is the drafter head's where joint reads it
    device: "torch.device"
    cuda_graphs: bool  # resolved: on for CUDA + lean + one process unless turned off
    drafter: str | None  # "eagle3" / "ngram", or None when the policy does not draft
    profile: CostTable | None  # the policy's own cost profile (evict, joint; optional for oracle)
    rules_profile: CostTable | None  # the profile the guard and the drafting stop rule read
    guard: str  # resolved: "measured", "profiled" or "off"
    draft_stop: bool  # resolved: whether drafting stops early (needs rules_profile.draft_forward)
    ddd_threshold: float | None  # resolved: 0.3 for ddd unless given
    oracle_predictor: bool  # experts from the target itself (analysis only)
    tree: TreeConfig  # resolved: the given tree, else the model's (`resolve.default_tree`)
    policy_options: dict[str, Any] = field(default_factory=dict)  # before EP's placement is added
    guard_prior: "SampledPrior | None" = None  # the measured guard's start for sampled requests (the model's own)

    @property
    def policy(self) -> str:
        return self.spec.policy

    @property
    def dtype(self) -> str:
        return self.runtime.dtype


def _check_paths(**paths) -> None:
    """A wrong type fails here with the argument's name, not as a TypeError deep inside pathlib or a policy."""
    for name, value in paths.items():
        allowed = (str, Path, CostTable) if name == "cost_profile" else (str, Path)
        if value is not None and not isinstance(value, allowed):
            kinds = "a path" + (", 'roofline:<device>' or a CostTable" if name == "cost_profile" else "")
            raise ValueError(f"{name} must be {kinds} or None, got {describe(value)}")


def is_int(x) -> bool:
    """An int that is not a bool (True would silently mean 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def describe(x) -> str:
    """A value's type and a short repr, for error messages."""
    text = repr(x)
    return f"{type(x).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
