"""The training corpus: the local Python standard library sources, split by file.

Choices (documented in ``assets/moespec-tiny/README.md``):
- root: ``sysconfig.get_paths()["stdlib"]``; only ``*.py`` files;
- ``site-packages`` / ``dist-packages`` are skipped (third-party, machine dependent);
- the stdlib's own test suites (``Lib/test`` etc.) are KEPT: they are ordinary
  Python code and double the corpus; no evaluation data set (HumanEval, MT-Bench,
  GSM8K) lives in the stdlib;
- files that are not valid UTF-8 or larger than ``max_file_bytes`` are skipped;
- the split is by file (sorted relative paths, shuffled with a fixed seed), so no
  held-out file is seen in training. One file = one document; documents are
  joined with the end-of-text token.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SKIPPED_DIR_NAMES = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class CorpusSplit:
    """Relative paths (to ``root``) of the train and held-out documents."""

    root: Path
    train: tuple[str, ...]
    heldout: tuple[str, ...]


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path, max_file_bytes: int = 1_000_000) -> list[str]:
    """Sorted relative paths of the usable ``.py`` files under ``root``."""
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if SKIPPED_DIR_NAMES.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        if path.stat().st_size > max_file_bytes or path.stat().st_size == 0:
            continue
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        paths.append(rel.as_posix())
    return sorted(paths)


def split_by_file(root: Path, heldout_fraction: float = 0.02, seed: int = 0) -> CorpusSplit:
    """Shuffle the source files with ``seed`` and hold out ``heldout_fraction`` of them."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    files = list_sources(root)
    if len(files) < 2:
        raise ValueError(f"corpus root {root} holds fewer than 2 usable .py files")
    random.Random(seed).shuffle(files)
    num_heldout = max(1, round(len(files) * heldout_fraction))
    return CorpusSplit(root=root, train=tuple(sorted(files[num_heldout:])), heldout=tuple(sorted(files[:num_heldout])))


def read_documents(root: Path, rel_paths: tuple[str, ...] | list[str]) -> list[str]:
    """The texts of ``rel_paths`` under ``root``, in order."""
    return [(root / rel).read_text(encoding="utf-8") for rel in rel_paths]
