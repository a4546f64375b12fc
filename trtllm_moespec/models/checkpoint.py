"""Checkpoint-directory checks shared by the target and drafter loaders.

The directory checks run before any weights are read, so a bad directory fails fast
with an error that names the problem: missing directory or config.json, pickle-only
weights (refused: safetensors only), missing shards, or a corrupt safetensors header.
`load_hf_checked` then loads a transformers model and refuses weights that do not
cover the model (a missing tensor would otherwise stay randomly initialised behind a
warning) or that disagree with config.json (e.g. its hidden_size).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """torch dtype from a name ("float32", "bfloat16", "float16") or a torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of float32, bfloat16, float16")
    return _DTYPES[dtype]


def read_config_json(path: str | Path, what: str) -> dict:
    """config.json of a local checkpoint directory, with errors that name the problem."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{what} directory not found: {path} (it does not exist; nothing is downloaded, "
                                "give a local path)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{what} has no config.json: {path}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} config.json is not valid JSON ({config_file}): {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{what} config.json must hold a JSON object, got {type(config).__name__} ({config_file})")
    return config


def check_safetensors_dir(path: Path, what: str) -> dict:
    """Validate a checkpoint directory and return its config.json as a dict."""
    path = Path(path)
    config = read_config_json(path, what)
    for shard in safetensors_files(path, what):
        check_safetensors_file(shard, what)
    return config


def safetensors_files(path: Path, what: str) -> list[Path]:
    """The weight shards of `path` (via model.safetensors.index.json when present)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        shards = sorted({path / name for name in weight_map.values()})
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise FileNotFoundError(f"{what} index names missing shards {missing} in {path}")
        return shards
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        return shards
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise ValueError(
            f"{what} at {path} has only pickle weights (*.bin/*.pt); only safetensors are loaded. "
            "Convert it, e.g. model.save_pretrained(dir, safe_serialization=True) in a trusted environment"
        )
    raise FileNotFoundError(f"{what} has no *.safetensors weights: {path}")


def check_safetensors_file(shard: Path, what: str) -> None:
    """Open the header of one shard; a truncated or garbled file raises ValueError naming it."""
    from safetensors import safe_open

    try:
        with safe_open(str(shard), framework="pt") as f:
            f.keys()
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError for I/O)
        raise ValueError(f"{what} weights file is corrupt or unreadable: {shard} ({e})") from None


def load_hf_checked(model_cls, path: Path, what: str, **kwargs):
    """`model_cls.from_pretrained(path, **kwargs)` that raises ValueError, naming the tensors, when the
    checkpoint lacks a tensor the model has or holds one of another shape than config.json implies.

    transformers would initialise such tensors randomly (with a warning) or raise a RuntimeError after
    printing a table; we ask it for the loading report instead and turn that into one line. Unexpected
    (extra) tensors are allowed: real checkpoints carry e.g. multi-token-prediction layers we do not use.
    """
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report would repeat what our error says
    try:
        model, info = model_cls.from_pretrained(str(path), output_loading_info=True, ignore_mismatched_sizes=True,
                                                **kwargs)
    finally:
        hf_logging.set_verbosity(level)
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda m: m[0])
    if mismatched:
        name, have, want = mismatched[0]
        raise ValueError(f"{what} at {path} does not match its config.json: {len(mismatched)} tensors have other "
                         f"shapes, e.g. {name} is {tuple(have)} in the weights but config.json implies {tuple(want)} "
                         "(check hidden_size, intermediate sizes, num_experts, vocab_size)")
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(f"{what} at {path} is missing {len(missing)} tensor(s) the model needs: {shown} "
                         "(the weights are incomplete or belong to another architecture)")
    return model
