"""Resumable checkpoints: weights and optimizer tensors in safetensors (no pickle),
optimizer hyper-parameters and progress in JSON.

A checkpoint directory is written under a temporary name and renamed into place,
so an interrupted save never leaves a half-written ``ckpt/``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


@dataclass(frozen=True)
class Progress:
    """Where a time-bounded run stands."""

    step: int  # optimizer steps done
    planned_s: float  # length of the cosine schedule, in training seconds
    tokens_seen: int
    elapsed_s: float  # training wall time over all sessions
    best_heldout_loss: float
    segment_start_s: float = 0.0  # elapsed_s where the current cosine segment began (> 0 after --extend-minutes)
    segment_peak_lr: float = 0.0  # peak lr of the current segment; 0 = the run's peak lr


def _state_dict_untied(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict with shared storages cloned (safetensors refuses aliases)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in module.state_dict().items():
        ptr = tensor.data_ptr()
        out[name] = tensor.detach().clone().contiguous() if ptr in seen else tensor.detach().contiguous()
        seen.add(ptr)
    return out


def save_checkpoint(out_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: Progress) -> Path:
    final = out_dir / "ckpt"
    tmp = out_dir / "ckpt.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(_state_dict_untied(model), str(tmp / "model.safetensors"))
    _save_optimizer(optimizer, tmp)
    (tmp / "progress.json").write_text(json.dumps(asdict(progress), indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def load_checkpoint(out_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Progress:
    ckpt = out_dir / "ckpt"
    for name in ("model.safetensors", "optimizer.safetensors", "optimizer.json", "progress.json"):
        if not (ckpt / name).is_file():
            raise FileNotFoundError(f"cannot resume: {ckpt / name} is missing")
    missing, unexpected = model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise ValueError(f"checkpoint {ckpt} does not match the model: missing {missing}, unexpected {unexpected}")
    if optimizer is not None:
        optimizer.load_state_dict(_load_optimizer(ckpt))
    return Progress(**json.loads((ckpt / "progress.json").read_text()))


def _save_optimizer(optimizer: torch.optim.Optimizer, ckpt: Path) -> None:
    """Per-parameter state tensors -> safetensors ("<param id>.<key>"); the rest -> JSON."""
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for pid, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{key}"] = value.detach().contiguous()
            else:
                scalars[f"{pid}.{key}"] = value
    save_file(tensors, str(ckpt / "optimizer.safetensors"))
    (ckpt / "optimizer.json").write_text(json.dumps({"param_groups": state["param_groups"], "scalars": scalars}))


def _load_optimizer(ckpt: Path) -> dict:
    meta = json.loads((ckpt / "optimizer.json").read_text())
    state: dict[int, dict] = {}
    for name, tensor in load_file(str(ckpt / "optimizer.safetensors")).items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = tensor
    for name, value in meta["scalars"].items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}
