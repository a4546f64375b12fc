"""A model's tuned policy options (`policy_defaults.json`): settings chosen for one model, tree and device.

A selection policy's fixed hyper-parameters are the paper's choices for the paper's models: EcoSpec's
verification budget gamma = 4 was picked as the best mean end-to-end speedup over seven data sets on
Qwen3-235B-A22B and GPT-OSS-120B. The same procedure on another model can pick another gamma
(moespec-base's six drafting steps fill longer chains). `moespec replay tune` runs it offline on recorded
steps and writes this file; the engine applies an entry wherever the user did not set that option and the
tree and device it was tuned for are the ones in use (else the policy's own default, logged).

    {"format": "moespec-policy-defaults/1", "model_id": "moespec-base",
     "policies": {"ecospec": {"options": {"budget": 6}, "tree": [6, 8, 32], "device": "cpu",
                              "made_by": "moespec replay tune ...", "grid": [...]}},
     "values": {"kind": "head", "tree": [6, 8, 32], "device": "cpu", "made_by": "moespec bench ..."}}

The optional "values" entry is the node-value model `values=None` (the default) resolves to for that tree
and device, chosen from side-by-side runs of the value models (elsewhere: "calibrated"). The optional "guard"
entry is the goodput guard's prior for sampled requests on that tree and device with the model's own drafter
(engine/guard.py `SampledPrior`: {"sampled": {"tokens_per_step": ..., "step_ratio": ..., "temperature": 1.0},
"tree": ..., "device": ..., and how it was measured}).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .core.policies import POLICIES

if TYPE_CHECKING:
    from .engine.guard import SampledPrior

log = logging.getLogger(__name__)
FORMAT = "moespec-policy-defaults/1"
FILE_NAME = "policy_defaults.json"


@dataclass(frozen=True)
class TunedOptions:
    """One policy's tuned options and where they hold."""

    options: dict[str, Any]  # keyword arguments of the policy (e.g. {"budget": 6})
    tree: tuple[int, int, int]  # (steps, topk, max_draft_tokens) it was tuned on
    device: str  # the cost profile's device it was tuned with ("cpu", "cuda:H200", ...)
    record: dict[str, Any]  # how it was chosen: command, criterion, the scored grid (for readers)


@dataclass(frozen=True)
class TunedValues:
    """The value model chosen for the model (`values=None`), and where it holds."""

    kind: str  # "raw", "calibrated" or "head" (core/values.py)
    tree: tuple[int, int, int]  # (steps, topk, max_draft_tokens) it was measured on
    device: str  # the cost profile's device it was measured with
    record: dict[str, Any]  # how it was chosen: command, the measured side-by-side runs (for readers)


@dataclass(frozen=True)
class TunedGuard:
    """The goodput guard's prior for sampled requests (engine/guard.py `SampledPrior`), and where it holds."""

    sampled: "SampledPrior"
    tree: tuple[int, int, int]  # (steps, topk, max_draft_tokens) it was measured on
    device: str  # the cost profile's device it was measured with
    record: dict[str, Any]  # how it was measured: command, the run it comes from (for readers)


@dataclass(frozen=True)
class PolicyDefaults:
    model_id: str
    policies: dict[str, TunedOptions]
    values: TunedValues | None = None
    guard: TunedGuard | None = None

    @classmethod
    def load(cls, path: str | Path) -> "PolicyDefaults":
        """Parse and check a file; ValueError naming the file and the problem."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"policy defaults {path} cannot be read as JSON: {e}") from e
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"policy defaults {path}: not a {FORMAT} file (its 'format' is "
                             f"{raw.get('format') if isinstance(raw, dict) else None!r})")
        entries = raw.get("policies")
        if not isinstance(entries, dict) or not isinstance(raw.get("model_id"), str):
            raise ValueError(f"policy defaults {path}: needs 'model_id' (a string) and 'policies' (an object)")
        values = _values_entry(path, raw["values"]) if "values" in raw else None
        guard = _guard_entry(path, raw["guard"]) if "guard" in raw else None
        return cls(raw["model_id"], {name: _entry(path, name, e) for name, e in entries.items()}, values, guard)

    def save(self, path: str | Path) -> None:
        policies = {name: {"options": t.options, "tree": list(t.tree), "device": t.device, **t.record}
                    for name, t in sorted(self.policies.items())}
        out = {"format": FORMAT, "model_id": self.model_id, "policies": policies}
        if self.values is not None:
            v = self.values
            out["values"] = {"kind": v.kind, "tree": list(v.tree), "device": v.device, **v.record}
        if self.guard is not None:
            g = self.guard
            out["guard"] = {"sampled": dataclasses.asdict(g.sampled), "tree": list(g.tree), "device": g.device,
                            **g.record}
        Path(path).write_text(json.dumps(out, indent=1) + "\n")

    def options_for(self, policy: str, tree: tuple[int, int, int], device: str) -> dict[str, Any]:
        """The tuned options of `policy` for this tree and device ({} where none apply)."""
        tuned = self.policies.get(policy)
        if not _holds(tuned, tree, device, f"{policy}'s tuned options {tuned and tuned.options}",
                      "the policy's own defaults apply"):
            return {}
        return dict(tuned.options)

    def values_for(self, tree: tuple[int, int, int], device: str) -> str | None:
        """The model's chosen value model for this tree and device (None where none applies)."""
        v = self.values
        return v.kind if _holds(v, tree, device, f"values={v and v.kind!r}", "'calibrated' applies") else None

    def guard_prior_for(self, tree: tuple[int, int, int], device: str) -> "SampledPrior | None":
        """The guard's sampled prior for this tree and device (None where none applies)."""
        g = self.guard
        return g.sampled if _holds(g, tree, device, "the guard's sampled prior", "sampled requests learn it") else None


def _holds(entry, tree: tuple[int, int, int], device: str, what: str, otherwise: str) -> bool:
    """Was `entry` (TunedOptions, TunedValues or TunedGuard; None: absent) chosen for this tree and device? Where
    it was chosen for another, say so (`what` it is, and what applies instead)."""
    if entry is None:
        return False
    if entry.tree != tuple(tree) or entry.device != device:
        log.info("%s: chosen for tree %s on %s; this run drafts %s on %s, so %s", what, entry.tree, entry.device,
                 tree, device, otherwise)
        return False
    return True


def _entry(path: Path, name: str, e: Any) -> TunedOptions:
    where = f"policy defaults {path}, policy {name!r}"
    if name not in POLICIES:
        raise ValueError(f"{where}: unknown policy; known: {', '.join(sorted(POLICIES))}")
    if not isinstance(e, dict) or not isinstance(e.get("options"), dict):
        raise ValueError(f"{where}: needs 'options' (an object)")
    known = {f.name for f in dataclasses.fields(POLICIES[name])}
    unknown = sorted(set(e["options"]) - known)
    if unknown:
        raise ValueError(f"{where}: unknown options {unknown}; the policy takes {sorted(known)}")
    tree, device = _where(where, e)
    record = {k: v for k, v in e.items() if k not in ("options", "tree", "device")}
    return TunedOptions(dict(e["options"]), tree, device, record)


def _values_entry(path: Path, e: Any) -> TunedValues:
    from .core.values import VALUE_KINDS

    where = f"policy defaults {path}, 'values'"
    if not isinstance(e, dict) or e.get("kind") not in VALUE_KINDS:
        raise ValueError(f"{where}: needs 'kind', one of {', '.join(VALUE_KINDS)}")
    tree, device = _where(where, e)
    return TunedValues(e["kind"], tree, device, {k: v for k, v in e.items() if k not in ("kind", "tree", "device")})


def _guard_entry(path: Path, e: Any) -> TunedGuard:
    from .engine.guard import SampledPrior

    where = f"policy defaults {path}, 'guard'"
    sampled = e.get("sampled") if isinstance(e, dict) else None
    if not isinstance(sampled, dict):
        raise ValueError(f"{where}: needs 'sampled' (an object: tokens_per_step, step_ratio, temperature)")
    try:
        prior = SampledPrior(**sampled)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: 'sampled': {err}") from None
    tree, device = _where(where, e)
    return TunedGuard(prior, tree, device, {k: v for k, v in e.items() if k not in ("sampled", "tree", "device")})


def _where(where: str, e: dict) -> tuple[tuple[int, int, int], str]:
    """An entry's (tree, device): the setting it was chosen in."""
    tree = e.get("tree")
    if not (isinstance(tree, list) and len(tree) == 3 and all(isinstance(x, int) and x > 0 for x in tree)):
        raise ValueError(f"{where}: 'tree' must be [steps, topk, max_draft_tokens], got {tree!r}")
    if not isinstance(e.get("device"), str):
        raise ValueError(f"{where}: 'device' must be a string")
    return tuple(tree), e["device"]


def with_tuned_options(policy: str, given: dict[str, Any], path: Path | None, model_id: str,
                       tree: tuple[int, int, int], device: str) -> dict[str, Any]:
    """`given` (the user's policy options) completed by the model's tuned ones where the user set none."""
    return merged_options(load_for(path, model_id), policy, given, tree, device)


def merged_options(defaults: PolicyDefaults | None, policy: str, given: dict[str, Any],
                   tree: tuple[int, int, int], device: str) -> dict[str, Any]:
    """`with_tuned_options` on an already loaded file (None: the model has none)."""
    return dict(given) if defaults is None else {**defaults.options_for(policy, tree, device), **given}


def load_for(path: Path | None, model_id: str) -> PolicyDefaults | None:
    """The model's policy defaults (None: it has no file); a file tuned for another model is refused."""
    if path is None or not path.is_file():
        return None
    defaults = PolicyDefaults.load(path)
    if defaults.model_id != model_id:
        raise ValueError(f"policy defaults {path} were tuned for model {defaults.model_id!r}, not {model_id!r}")
    return defaults
