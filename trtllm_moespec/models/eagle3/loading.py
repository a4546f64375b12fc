"""EAGLE-3 checkpoint I/O in the SpecForge / SGLang format (`config.json` + safetensors): loading a
drafter (checked against its target) and writing a randomly initialised one for smoke tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint import check_safetensors_dir, parse_dtype, safetensors_files
from .modeling import Eagle3Drafter
from .types import Eagle3Config

def load_eagle3(path: str | Path, target=None, device: str | torch.device | None = None,
                dtype: str | torch.dtype | None = None) -> Eagle3Drafter:
    """Load a SpecForge/SGLang EAGLE-3 checkpoint directory; `target` (a TargetModel) is
    checked for matching sizes and lends its embedding when the checkpoint has none.
    device/dtype default to the target's (else cpu / float32)."""
    from safetensors.torch import load_file

    path = Path(path)
    device = device if device is not None else (target.device if target is not None else "cpu")
    dtype = parse_dtype(dtype if dtype is not None else (target.dtype if target is not None else "float32"))
    config = Eagle3Config.from_dict(check_safetensors_dir(path, what="EAGLE-3 drafter"))
    weights: dict[str, torch.Tensor] = {}
    for shard in safetensors_files(path, "EAGLE-3 drafter"):
        weights.update({k.removeprefix("model."): v for k, v in load_file(str(shard)).items()})
    if target is not None:
        _check_matches_target(config, target, has_embeddings="embed_tokens.weight" in weights)
    embed = None
    if "embed_tokens.weight" not in weights:
        if target is None:
            raise ValueError(f"EAGLE-3 drafter at {path} has no embed_tokens.weight; pass the target to share its embedding")
        embed = target.input_embeddings()
        if embed.weight.dtype != dtype or not _same_device(embed.weight.device, torch.device(device)):
            raise ValueError(f"a drafter sharing the target embedding must use the target's device/dtype "
                             f"({embed.weight.device}, {embed.weight.dtype}), got ({device}, {dtype})")
    drafter = Eagle3Drafter(config, embed_tokens=embed)
    _load_weights(drafter, weights, path, shared_embedding=embed is not None)
    return drafter.to(device=device, dtype=dtype).eval()


def _same_device(actual: torch.device, wanted: torch.device) -> bool:
    return actual.type == wanted.type and (wanted.index is None or actual.index == wanted.index)


def _check_matches_target(c: Eagle3Config, target, has_embeddings: bool) -> None:
    if c.target_hidden_size != target.hidden_size:
        raise ValueError(f"drafter target_hidden_size {c.target_hidden_size} != target hidden size {target.hidden_size}")
    if c.vocab_size != target.vocab_size:
        raise ValueError(f"drafter vocab_size {c.vocab_size} != target vocab_size {target.vocab_size}")
    if not has_embeddings and c.hidden_size != target.hidden_size:
        raise ValueError(f"drafter without embeddings has hidden_size {c.hidden_size}, which must equal the target "
                         f"hidden size {target.hidden_size} to share its embedding")


def _load_weights(drafter: Eagle3Drafter, weights: dict, path: Path, shared_embedding: bool) -> None:
    expected = {k: v for k, v in drafter.state_dict().items() if not (shared_embedding and k.startswith("embed_tokens."))}
    missing = sorted(set(expected) - set(weights) - {"t2d", "d2t"})
    if missing:
        raise ValueError(f"EAGLE-3 drafter at {path} is missing tensors {missing}")
    for name, ref in expected.items():
        if name in weights and tuple(weights[name].shape) != tuple(ref.shape):
            raise ValueError(f"EAGLE-3 tensor {name} has shape {tuple(weights[name].shape)}, config implies {tuple(ref.shape)}")
    d2t = weights.get("d2t", torch.zeros(drafter.config.draft_vocab_size, dtype=torch.int64)).long()
    target_ids = torch.arange(d2t.numel()) + d2t
    if target_ids.numel() and (target_ids.min() < 0 or target_ids.max() >= drafter.config.vocab_size):
        raise ValueError(f"EAGLE-3 d2t maps draft ids outside the target vocabulary [0, {drafter.config.vocab_size})")
    weights = dict(weights, d2t=d2t, t2d=weights.get("t2d", drafter.t2d).bool())
    drafter.load_state_dict({k: weights[k] for k in expected}, strict=False)


def write_random_drafter(target_config, out_dir: str | Path, seed: int = 0, hidden_size: int | None = None,
                         draft_vocab_size: int | None = None, with_embeddings: bool = True,
                         init_std: float = 0.05) -> Path:
    """Write a randomly initialised EAGLE-3 head for a target with `target_config` (a transformers
    config) in the SpecForge/SGLang format: config.json + model.safetensors. For smoke tests."""
    from safetensors.torch import save_file

    tc = target_config
    hidden = hidden_size or tc.hidden_size
    heads = max(1, min(tc.num_attention_heads, hidden // 16))
    vocab = tc.vocab_size
    config = Eagle3Config(
        hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
        num_key_value_heads=heads, head_dim=hidden // heads, vocab_size=vocab,
        draft_vocab_size=draft_vocab_size or vocab, target_hidden_size=tc.hidden_size,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6), max_position_embeddings=tc.max_position_embeddings,
    )
    gen = torch.Generator().manual_seed(seed)
    drafter = Eagle3Drafter(config)
    tensors = {}
    for name, t in drafter.state_dict().items():
        if name in ("d2t", "t2d") or (name.startswith("embed_tokens.") and not with_embeddings):
            continue
        is_norm = name.endswith("norm.weight")
        tensors[name] = torch.ones_like(t) if is_norm else torch.randn(t.shape, generator=gen) * init_std
    hot = torch.randperm(vocab, generator=gen)[: config.draft_vocab_size].sort().values
    tensors["d2t"] = hot - torch.arange(config.draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    tensors["t2d"] = t2d
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out
