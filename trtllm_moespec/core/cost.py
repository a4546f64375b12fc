"""Cost models of one speculative iteration.

- `CostTable`: C(k) for k = 0..K verified draft nodes, profiled on the hardware in
  use (median of repeated whole iterations), stored as JSON with the metadata
  that says what it is valid for (model, device, dtype, tree config).
- `ExpertCostModel`: C(k, U) = c0 + c_tok * k + c_exp * U, fitted by least squares
  over profiled steps, U = unique activated (layer, expert) pairs; with the within-k
  slope of U and the spread of U at fixed k, which say what choosing nodes by their
  experts can save at all (`expert_term_pays`).
- `RooflineCostModel`: a bandwidth/compute estimate from a model config and a
  device preset, for planning without the hardware (see presets.py for numbers).
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .presets import DEVICES, DevicePreset, MoEArchitecture

COST_PROFILE_VERSION = 1


@dataclass(frozen=True)
class CostTable:
    """Profiled step cost C(k) in seconds for k = 0..K verified draft nodes."""

    costs: tuple[float, ...]  # C(0) .. C(K), seconds
    model_id: str = "unknown"
    device: str = "unknown"
    dtype: str = "unknown"
    tree: tuple[int, int, int] | None = None  # (steps, topk, max_draft_tokens) it was measured with
    method: str = ""  # how it was measured, free text
    date: str = field(default_factory=lambda: _dt.date.today().isoformat())
    spread: tuple[float, ...] | None = None  # e.g. inter-quartile range per k, seconds
    expert_model: "ExpertCostModel | None" = None  # optional fit stored beside the table
    plain_step: float | None = None  # seconds of a plain decoding step (no drafting), for k = 0 before drafting
    draft_forward: float | None = None  # seconds of one drafter forward while drafting a tree
    load_average: tuple[float, ...] | None = None  # os.getloadavg() before and after measuring
    # seconds per speculative step that joint's expert term adds: the expert predictor and the expert-aware
    # greedy selection, beyond EVICT's prefix selection (median over steps; `moespec profile`)
    expert_overhead: float | None = None

    def __post_init__(self) -> None:
        costs = tuple(float(c) for c in self.costs)
        object.__setattr__(self, "costs", costs)
        if len(costs) < 1:
            raise ValueError("cost table is empty: need C(0) .. C(K)")
        for k, c in enumerate(costs):
            if not math.isfinite(c):
                raise ValueError(f"cost table entry C({k}) is not finite ({c})")
            if c <= 0:
                raise ValueError(f"cost table entry C({k}) = {c} is not positive")
        for name in ("plain_step", "draft_forward"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"cost profile field {name} must be a positive number of seconds, got {v!r}")
        v = self.expert_overhead
        if v is not None and not (_is_number(v) and math.isfinite(v) and v >= 0):
            raise ValueError(f"cost profile field expert_overhead must be a number of seconds >= 0, got {v!r}")
        if self.tree is not None:
            object.__setattr__(self, "tree", tuple(int(x) for x in self.tree))
            if len(self.tree) != 3:
                raise ValueError(f"tree must be (steps, topk, max_draft_tokens), got {self.tree}")

    @property
    def max_nodes(self) -> int:
        return len(self.costs) - 1

    @functools.cached_property
    def costs_array(self) -> np.ndarray:
        """[K+1] float64 C(k) as numpy, made once (host selection reads it every step)."""
        return np.asarray(self.costs, dtype=np.float64)

    def as_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[K+1] float64 C(k)."""
        return torch.tensor(self.costs, dtype=torch.float64, device=device)

    def check_compatible(
        self,
        model_id: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        tree: tuple[int, int, int] | None = None,
        override: bool = False,
    ) -> None:
        """Raise ValueError if this table was made for another model, device, dtype or tree."""
        problems = []
        for name, want in (("model", model_id), ("device", device), ("dtype", dtype)):
            have = {"model": self.model_id, "device": self.device, "dtype": self.dtype}[name]
            if want is not None and have != want:
                problems.append(f"{name} {have!r} (expected {want!r})")
        if tree is not None and self.tree is not None and tuple(tree) != tuple(self.tree):
            problems.append(f"tree {tuple(self.tree)} (expected {tuple(tree)})")
        if tree is not None and self.max_nodes < tree[2]:
            problems.append(f"only {self.max_nodes} nodes profiled (tree needs {tree[2]})")
        if problems and not override:
            raise ValueError(
                "cost profile was made for " + ", ".join(problems) + "; re-profile with `moespec profile` "
                "or pass override=True (--override-profile) to use it anyway"
            )

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["version"] = COST_PROFILE_VERSION
        d["expert_model"] = asdict(self.expert_model) if self.expert_model else None
        return d

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(path)  # never leave a half-written profile behind
        return path

    @staticmethod
    def from_json(d: dict[str, Any]) -> "CostTable":
        """Parse the JSON form; every field's type is checked so a hand-edited file fails naming the field."""
        if not isinstance(d, dict) or "costs" not in d:
            raise ValueError("not a cost profile: missing 'costs'")
        if d.get("version", COST_PROFILE_VERSION) != COST_PROFILE_VERSION:
            raise ValueError(f"cost profile version {d.get('version')} is not supported (expected {COST_PROFILE_VERSION})")
        for name in ("model_id", "device", "dtype", "method", "date"):
            if d.get(name) is not None and not isinstance(d[name], str):
                raise ValueError(f"field {name!r} must be a string, got {d[name]!r}")
        em = d.get("expert_model")
        return CostTable(
            costs=_numbers(d["costs"], "costs"),
            model_id=d.get("model_id", "unknown"),
            device=d.get("device", "unknown"),
            dtype=d.get("dtype", "unknown"),
            tree=_tree_field(d["tree"]) if d.get("tree") is not None else None,
            method=d.get("method", ""),
            date=d.get("date", ""),
            spread=_numbers(d["spread"], "spread") if d.get("spread") is not None else None,
            expert_model=_expert_model_field(em) if em else None,
            plain_step=d.get("plain_step"),
            draft_forward=d.get("draft_forward"),
            load_average=_numbers(d["load_average"], "load_average") if d.get("load_average") is not None else None,
            expert_overhead=d.get("expert_overhead"),
        )

    @staticmethod
    def load(path: str | Path, *, model_id: str | None = None, device: str | None = None, dtype: str | None = None,
             tree: tuple[int, int, int] | None = None, override: bool = False) -> "CostTable":
        """Read and validate a cost profile; refuse one made for another setting unless override."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"cost profile not found: {path}")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"cost profile {path} is not valid JSON: {e}") from None
        try:
            table = CostTable.from_json(data)
        except ValueError as e:
            raise ValueError(f"cost profile {path}: {e}") from None
        table.check_compatible(model_id, device, dtype, tree, override)
        return table


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _numbers(value: Any, name: str) -> tuple[float, ...]:
    if not isinstance(value, list) or not all(_is_number(x) for x in value):
        raise ValueError(f"field {name!r} must be a list of numbers (seconds), got {value!r:.80}")
    return tuple(float(x) for x in value)


def _tree_field(value: Any) -> tuple[int, int, int]:
    if not isinstance(value, list) or len(value) != 3 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                 for x in value):
        raise ValueError(f"field 'tree' must be [steps, topk, max_draft_tokens] integers, got {value!r:.80}")
    return tuple(value)


def _expert_model_field(value: Any) -> "ExpertCostModel":
    names = ("c0", "c_tok", "c_exp", "residual_rms", "num_samples", "c_exp_within", "unique_spread")
    if not isinstance(value, dict):
        raise ValueError(f"field 'expert_model' must be an object with {', '.join(names[:3])}, got {value!r:.80}")
    for key, x in value.items():
        if key not in names:
            raise ValueError(f"field 'expert_model.{key}' is unknown (expected {', '.join(names)})")
        if not _is_number(x) and not (x is None and key in names[5:]):
            raise ValueError(f"field 'expert_model.{key}' must be a number, got {x!r:.80}")
    missing = [k for k in names[:3] if k not in value]
    if missing:
        raise ValueError(f"field 'expert_model' lacks {', '.join(missing)}")
    try:
        return ExpertCostModel(**value)
    except ValueError as e:
        raise ValueError(f"field 'expert_model': {e}") from None


@dataclass(frozen=True)
class ExpertCostModel:
    """C(k, U) = c0 + c_tok * k + c_exp * U (seconds), with the fit's residual error.

    The global fit's c_exp also absorbs the curvature of C(k) (U grows with k), so what a
    step costs per extra woken expert *at a fixed number of verified tokens*, the only
    thing choosing nodes by their experts can change, is fitted apart: `c_exp_within`,
    the pooled within-k slope (one intercept per k), and `unique_spread`, the pooled
    standard deviation of U at fixed k (k >= 1). None in profiles made before them."""

    c0: float
    c_tok: float
    c_exp: float
    residual_rms: float = 0.0  # seconds, root-mean-square residual of the fit
    num_samples: int = 0
    c_exp_within: float | None = None  # seconds per woken (layer, expert) pair at fixed k, >= 0
    unique_spread: float | None = None  # pairs: standard deviation of U at fixed k (k >= 1), pooled

    def __post_init__(self) -> None:
        for name in ("c0", "c_tok", "c_exp"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"ExpertCostModel.{name} is not finite")
        if self.c0 <= 0:
            raise ValueError(f"ExpertCostModel.c0 must be positive (a step always costs something), got {self.c0}")
        for name in ("c_exp_within", "unique_spread"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"ExpertCostModel.{name} must be a finite number >= 0, got {v}")

    def predict(self, k: float | np.ndarray, unique: float | np.ndarray) -> float | np.ndarray:
        return self.c0 + self.c_tok * k + self.c_exp * unique

    @property
    def expert_saving(self) -> float | None:
        """Seconds per step that choosing nodes by their experts can move at a fixed verified count:
        one standard deviation of U at fixed k, priced at the within-k slope (None: not fitted)."""
        if self.c_exp_within is None or self.unique_spread is None:
            return None
        return self.c_exp_within * self.unique_spread

    @staticmethod
    def fit(k: np.ndarray, unique: np.ndarray, latency: np.ndarray) -> "ExpertCostModel":
        """Least squares over profiled (k, U, seconds) samples; slopes are clamped at >= 0."""
        k, unique, latency = (np.asarray(x, dtype=np.float64).ravel() for x in (k, unique, latency))
        if not (len(k) == len(unique) == len(latency)) or len(k) < 3:
            raise ValueError("need at least 3 (k, U, latency) samples of equal length to fit the cost model")
        if not (np.isfinite(k).all() and np.isfinite(unique).all() and np.isfinite(latency).all()):
            raise ValueError("cost samples contain NaN or inf")
        X = np.stack([np.ones_like(k), k, unique], 1)
        # A negative slope is noise (more work never makes a step faster): drop it and refit.
        cols = [0, 1, 2]
        while True:
            sub, *_ = np.linalg.lstsq(X[:, cols], latency, rcond=None)
            coef = np.zeros(3)
            coef[cols] = sub
            negative = [c for c in cols[1:] if coef[c] < 0]
            if not negative:
                break
            cols.remove(min(negative, key=lambda c: coef[c]))
        resid = latency - X @ coef
        c0 = max(float(coef[0]), 1e-9)
        within, spread = _within_k(k, unique, latency)
        return ExpertCostModel(c0, float(coef[1]), float(coef[2]), float(np.sqrt(np.mean(resid**2))), len(k),
                               within, spread)


def _within_k(k: np.ndarray, unique: np.ndarray, latency: np.ndarray) -> tuple[float | None, float | None]:
    """(pooled within-k slope of latency on U, clamped >= 0; pooled standard deviation of U at fixed k >= 1):
    each k's own mean is removed first, so the k-curve cannot leak into the slope. None without spread."""
    du, dt = np.empty(0), np.empty(0)
    for value in np.unique(k):
        at = k == value
        if at.sum() < 2 or value < 1:
            continue
        du = np.concatenate([du, unique[at] - unique[at].mean()])
        dt = np.concatenate([dt, latency[at] - latency[at].mean()])
    if len(du) < 2 or not (du**2).sum() > 0:
        return None, None
    return max(float((du * dt).sum() / (du**2).sum()), 0.0), float(np.sqrt(np.mean(du**2)))


def expert_term_pays(table: CostTable) -> tuple[bool, str]:
    """Should joint pay for its expert term (the predictor and the expert-aware greedy) on this profile?

    It can save at most about `ExpertCostModel.expert_saving` per step (a standard deviation
    of U at fixed k, at the within-k price) and costs `CostTable.expert_overhead`. Where the
    profile lacks either measurement the term stays on (the behaviour before they existed).
    Returns (decision, the reason in words)."""
    m = table.expert_model
    saving = m.expert_saving if m is not None else None
    if saving is None or table.expert_overhead is None:
        return True, "the cost profile does not measure what the expert term saves and costs (re-run `moespec profile`)"
    verdict = "pays" if saving >= table.expert_overhead else "does not pay"
    return saving >= table.expert_overhead, (
        f"the expert term {verdict}: choosing nodes by their experts can move a step by ~{saving * 1e3:.2f} ms "
        f"({m.unique_spread:.0f} (layer, expert) pairs at {m.c_exp_within * 1e6:.1f} us each, fixed k) and costs "
        f"{table.expert_overhead * 1e3:.2f} ms (predictor and greedy selection)")


@dataclass(frozen=True)
class RooflineCostModel:
    """Roofline estimate of one verify forward: max(bytes / bandwidth, flops / peak) + overhead.

    bytes = dense weights + U * bytes per expert + KV cache read; flops = 2 * active
    parameters * tokens. U counts unique (layer, expert) pairs over the verified tokens.
    """

    arch: MoEArchitecture
    device: DevicePreset
    dtype_bytes: float = 2.0  # bf16 weights; override for fp8 / mxfp4 experts
    overhead_s: float = 20e-6  # launch / sync overhead per step

    @staticmethod
    def for_device(arch: MoEArchitecture, device: str, dtype_bytes: float | None = None) -> "RooflineCostModel":
        if device not in DEVICES:
            raise ValueError(f"unknown device preset {device!r}; known: {sorted(DEVICES)}")
        return RooflineCostModel(arch, DEVICES[device], arch.expert_bytes_per_param if dtype_bytes is None else dtype_bytes)

    def step_seconds(self, num_tokens: int, unique_experts: float, context_len: int) -> float:
        a = self.arch
        bytes_moved = (
            a.dense_params * 2.0  # attention/router/norm/embedding weights stay bf16
            + unique_experts * a.expert_params * self.dtype_bytes
            + context_len * a.kv_bytes_per_token
        )
        flops = 2.0 * num_tokens * (a.dense_params + a.num_layers * a.top_k * a.expert_params)
        return max(bytes_moved / self.device.bandwidth_Bps, flops / self.device.peak_flops) + self.overhead_s

    def expected_unique(self, num_tokens: int) -> float:
        """U under independent uniform routing: L * E * (1 - (1 - k/E)^n) (an upper-ish estimate)."""
        a = self.arch
        return a.num_layers * a.num_experts * (1.0 - (1.0 - a.top_k / a.num_experts) ** num_tokens)

    def cost_table(self, max_nodes: int, context_len: int = 2048, model_id: str | None = None) -> CostTable:
        """A clearly labelled estimated C(k) table (root + k nodes verified, uniform routing)."""
        costs = [self.step_seconds(k + 1, self.expected_unique(k + 1), context_len) for k in range(max_nodes + 1)]
        return CostTable(
            tuple(costs), model_id=model_id or self.arch.name, device=self.device.name, dtype=f"{self.dtype_bytes}B",
            method=f"roofline estimate (uniform routing, context {context_len}); not measured",
        )

    def expert_model(self, context_len: int = 2048) -> ExpertCostModel:
        """The linear C(k, U) this roofline implies in the bandwidth-bound regime."""
        a = self.arch
        bw = self.device.bandwidth_Bps
        c0 = (a.dense_params * 2.0 + context_len * a.kv_bytes_per_token) / bw + self.overhead_s
        return ExpertCostModel(c0=c0, c_tok=0.0, c_exp=a.expert_params * self.dtype_bytes / bw)
