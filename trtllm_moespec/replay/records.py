"""Replay records: every step of a live decode with its whole draft tree and the target's verdict
on every node, stored flat in one safetensors file (no pickle).

Per step s the nodes are rows cu_nodes[s]:cu_nodes[s+1] of the node arrays (parents are
step-local indices, -1 = root). `target_local` is the target's probability of each node's
token given its path under the request's sampling (one-hot match at T=0), read off one
extra "peek" forward over the full tree; `true_experts` are the target's real routing of
every node from the same forward. Header metadata (JSON) says how the file was made.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from ..core.experts import ExpertSets
from ..core.tree import DraftTree

RECORD_FORMAT = "moespec-replay"

# name -> (per node | per step | per request, dtype); the node arrays are aligned with cu_nodes.
NODE_FIELDS = {
    "token_ids": np.int64, "parents": np.int64, "valid": np.uint8, "draft_probs": np.float32, "target_local": np.float32,
    "values": np.float32, "pred_experts": np.int64, "true_experts": np.int64, "node_hidden": np.float16,
}
STEP_FIELDS = {
    "cu_nodes": np.int64, "request": np.int64, "context_len": np.int64, "root_pred_experts": np.int64,
    "root_true_experts": np.int64, "live_num_selected": np.int64, "live_num_accepted": np.int64,
    "cu_selected": np.int64, "live_selected": np.int64,
}
REQUEST_FIELDS = {"cu_context": np.int64, "context_ids": np.int64, "temperature": np.float32}


@dataclass(frozen=True)
class StepRecord:
    """One recorded step, as the policies see it (batch of one)."""

    tree: DraftTree  # [1, N]
    target_local: torch.Tensor  # [1, N] target probability of each node given its path
    values: torch.Tensor  # [1, N] the live value model's values (raw scores when the policy used none)
    experts: ExpertSets  # predicted per-node sets [1, N, W]
    root_experts: torch.Tensor  # [1, W] predicted root set
    true_experts: torch.Tensor  # [1, N, W] the target's routing of every node
    root_true_experts: torch.Tensor  # [1, W]
    node_hidden: torch.Tensor | None  # [1, N, H] drafter features (None when not recorded)
    context: list[int]  # committed tokens, root last
    temperature: float
    request: int
    live_selected: list[int]  # the live policy's verified nodes, in order
    live_num_accepted: int


@dataclass(frozen=True)
class ReplayFile:
    arrays: dict[str, np.ndarray]
    meta: dict  # model, tree, policy, values, num_layers, num_experts, command, datasets, prompts

    @property
    def num_steps(self) -> int:
        return len(self.arrays["cu_nodes"]) - 1

    def step(self, s: int) -> StepRecord:
        a = self.arrays
        lo, hi = int(a["cu_nodes"][s]), int(a["cu_nodes"][s + 1])
        t = lambda name: torch.from_numpy(np.ascontiguousarray(a[name][lo:hi]))[None]  # noqa: E731
        tree = _tree(a["token_ids"][lo:hi], a["parents"][lo:hi], a["draft_probs"][lo:hi], a["valid"][lo:hi])
        L, E = self.meta["num_layers"], self.meta["num_experts"]
        r = int(a["request"][s])
        c0 = int(a["cu_context"][r])
        sl, sh = int(a["cu_selected"][s]), int(a["cu_selected"][s + 1])
        hidden = (torch.from_numpy(a["node_hidden"][lo:hi].astype(np.float32))[None]
                  if "node_hidden" in a and len(a["node_hidden"]) else None)
        return StepRecord(
            tree=tree, target_local=t("target_local"), values=t("values"),
            experts=ExpertSets(t("pred_experts"), L, E),
            root_experts=torch.from_numpy(a["root_pred_experts"][s:s + 1].copy()), true_experts=t("true_experts"),
            root_true_experts=torch.from_numpy(a["root_true_experts"][s:s + 1].copy()), node_hidden=hidden,
            context=a["context_ids"][c0:c0 + int(a["context_len"][s])].tolist(), temperature=float(a["temperature"][r]),
            request=r, live_selected=a["live_selected"][sl:sh].tolist(), live_num_accepted=int(a["live_num_accepted"][s]))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: np.ascontiguousarray(v) for k, v in self.arrays.items()}, str(path),
                  metadata={"format": RECORD_FORMAT, "meta": json.dumps(self.meta)})
        return path

    @staticmethod
    def load(path: str | Path) -> "ReplayFile":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"replay file not found: {path}")
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="numpy") as f:
                header = f.metadata() or {}
            arrays = load_file(str(path))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{path} is not a replay file: {err}") from None
        if header.get("format") != RECORD_FORMAT:
            raise ValueError(f"{path} is not a replay file (format {header.get('format')!r}, expected {RECORD_FORMAT!r})")
        missing = (set(NODE_FIELDS) | set(STEP_FIELDS) | set(REQUEST_FIELDS)) - set(arrays) - {"node_hidden"}
        if missing:
            raise ValueError(f"replay file {path} lacks the arrays {sorted(missing)}")
        return ReplayFile(arrays, json.loads(header["meta"]))


def _tree(tokens: np.ndarray, parents: np.ndarray, q: np.ndarray, valid: np.ndarray) -> DraftTree:
    """DraftTree.from_parents for one recorded tree, in numpy (replay reads thousands of trees)."""
    valid = valid.astype(bool)
    if (valid & (parents >= np.arange(len(parents)))).any() or ((q[valid] < 0) | (q[valid] > 1 + 1e-5)).any():
        raise ValueError("replay file holds a malformed tree (parents must point backwards, q in [0, 1])")
    depth = np.zeros(len(parents), dtype=np.int64)
    log_s = np.full(len(parents), -np.inf, dtype=np.float32)
    log_q = np.log(np.clip(q, 0.0, 1.0).astype(np.float32))
    for i, p in enumerate(parents.tolist()):  # topological order
        if valid[i]:
            depth[i] = 1 + (depth[p] if p >= 0 else 0)
            log_s[i] = log_q[i] + (log_s[p] if p >= 0 else 0.0)
    as_t = lambda x: torch.from_numpy(np.ascontiguousarray(x))[None]  # noqa: E731
    return DraftTree(as_t(tokens.astype(np.int64)), as_t(np.where(valid, parents, -1)), as_t(depth),
                     as_t(np.clip(q, 0.0, 1.0).astype(np.float32)), as_t(log_s), as_t(valid))


class RecordBuilder:
    """Accumulates steps and requests; `build()` returns the ReplayFile."""

    def __init__(self, meta: dict):
        self.meta = meta
        self.nodes: dict[str, list[np.ndarray]] = {k: [] for k in NODE_FIELDS}
        self.steps: dict[str, list] = {k: [] for k in STEP_FIELDS if not k.startswith("cu_")}
        self.selected: list[np.ndarray] = []
        self.num_nodes: list[int] = []
        self.contexts: list[list[int]] = []
        self.temperatures: list[float] = []

    def start_request(self, temperature: float) -> int:
        self.contexts.append([])
        self.temperatures.append(float(temperature))
        return len(self.contexts) - 1

    def finish_request(self, context: list[int]) -> None:
        self.contexts[-1] = list(context)

    def add_step(self, nodes: dict[str, np.ndarray], request: int, context_len: int, root_pred: np.ndarray,
                 root_true: np.ndarray, selected: np.ndarray, num_accepted: int) -> None:
        n = len(nodes["token_ids"])
        for k in NODE_FIELDS:
            if k in nodes:
                self.nodes[k].append(np.asarray(nodes[k], dtype=NODE_FIELDS[k]))
        self.num_nodes.append(n)
        self.steps["request"].append(request)
        self.steps["context_len"].append(context_len)
        self.steps["root_pred_experts"].append(root_pred)
        self.steps["root_true_experts"].append(root_true)
        self.steps["live_num_selected"].append(len(selected))
        self.steps["live_num_accepted"].append(num_accepted)
        self.selected.append(np.asarray(selected, dtype=np.int64))

    def build(self) -> ReplayFile:
        W = len(self.steps["root_true_experts"][0]) if self.steps["root_true_experts"] else 1
        arrays = {}
        for k, parts in self.nodes.items():
            if parts:
                arrays[k] = np.concatenate(parts)
            elif k != "node_hidden":
                arrays[k] = np.zeros((0, W) if "experts" in k else (0,), dtype=NODE_FIELDS[k])
        arrays["cu_nodes"] = np.concatenate([[0], np.cumsum(self.num_nodes)]).astype(np.int64)
        for k in ("request", "context_len", "live_num_selected", "live_num_accepted"):
            arrays[k] = np.asarray(self.steps[k], dtype=np.int64)
        for k in ("root_pred_experts", "root_true_experts"):
            arrays[k] = np.stack(self.steps[k]).astype(np.int64) if self.steps[k] else np.zeros((0, W), np.int64)
        arrays["cu_selected"] = np.concatenate([[0], np.cumsum([len(x) for x in self.selected])]).astype(np.int64)
        arrays["live_selected"] = np.concatenate(self.selected) if self.selected else np.zeros(0, np.int64)
        arrays["cu_context"] = np.concatenate([[0], np.cumsum([len(c) for c in self.contexts])]).astype(np.int64)
        arrays["context_ids"] = np.asarray([t for c in self.contexts for t in c], dtype=np.int64)
        arrays["temperature"] = np.asarray(self.temperatures, dtype=np.float32)
        return ReplayFile(arrays, self.meta)
