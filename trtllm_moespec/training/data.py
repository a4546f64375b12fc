"""Token streams of the corpus and the batches cut from them.

Each split is one flat ``uint16`` stream: document tokens followed by the
end-of-text id, in the (sorted) file order of the split. Training batches are
random windows of ``seq_len + 1`` tokens; the window starts of step ``s`` are drawn
from a generator seeded with ``(seed, s)`` so a resumed run sees the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from trtllm_moespec.training.corpus import CorpusSplit, read_documents
from trtllm_moespec.training.tokenizer import EOT_TOKEN


@dataclass(frozen=True)
class TokenStreams:
    """The encoded corpus."""

    train: np.ndarray  # [T_train] uint16
    heldout: np.ndarray  # [T_heldout] uint16
    num_train_bytes: int
    num_heldout_bytes: int


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """Concatenate the token ids of ``texts``, each followed by end-of-text."""
    eot_id = tokenizer.token_to_id(EOT_TOKEN)
    if eot_id is None:
        raise ValueError(f"tokenizer has no {EOT_TOKEN} token")
    if tokenizer.get_vocab_size() > np.iinfo(np.uint16).max:
        raise ValueError("vocabulary too large for uint16 streams")
    pieces = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        pieces.append(np.asarray(encoding.ids + [eot_id], dtype=np.uint16))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


def build_streams(tokenizer: Tokenizer, split: CorpusSplit) -> TokenStreams:
    """Encode both splits of ``split``."""
    train_texts = read_documents(split.root, split.train)
    heldout_texts = read_documents(split.root, split.heldout)
    return TokenStreams(
        train=encode_documents(tokenizer, train_texts),
        heldout=encode_documents(tokenizer, heldout_texts),
        num_train_bytes=sum(len(t.encode("utf-8")) for t in train_texts),
        num_heldout_bytes=sum(len(t.encode("utf-8")) for t in heldout_texts),
    )


def save_streams(streams: TokenStreams, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / "train.npy", streams.train)
    np.save(out_dir / "heldout.npy", streams.heldout)
    (out_dir / "bytes.txt").write_text(f"{streams.num_train_bytes} {streams.num_heldout_bytes}\n")


def load_streams(data_dir: Path) -> TokenStreams:
    for name in ("train.npy", "heldout.npy", "bytes.txt"):
        if not (data_dir / name).is_file():
            raise FileNotFoundError(f"{data_dir / name} missing: run `build_scripts/train_model.py tokenizer` first")
    num_train_bytes, num_heldout_bytes = (int(x) for x in (data_dir / "bytes.txt").read_text().split())
    return TokenStreams(
        train=np.load(data_dir / "train.npy"),
        heldout=np.load(data_dir / "heldout.npy"),
        num_train_bytes=num_train_bytes,
        num_heldout_bytes=num_heldout_bytes,
    )


def random_windows(stream: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
    """``batch_size`` random windows of ``seq_len + 1`` tokens: [B, seq_len + 1] int64."""
    if len(stream) <= seq_len + 1:
        raise ValueError(f"stream of {len(stream)} tokens is too short for windows of {seq_len + 1}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch_size)
    rows = np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows)


def contiguous_windows(stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows covering ``stream`` from its start: [W, seq_len + 1] int64."""
    num_windows = (len(stream) - 1) // seq_len
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    if num_windows < 1:
        raise ValueError(f"stream of {len(stream)} tokens is too short for one window of {seq_len + 1}")
    rows = [stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(num_windows)]
    return torch.from_numpy(np.stack(rows).astype(np.int64))
