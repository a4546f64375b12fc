"""Corpus: file listing rules and a deterministic, disjoint split by file."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtllm_moespec.training.corpus import list_sources, split_by_file


def _make_tree(root: Path) -> None:
    for i in range(50):
        (root / "pkg").mkdir(parents=True, exist_ok=True)
        (root / "pkg" / f"m{i}.py").write_text(f"x = {i}\n")
    (root / "site-packages" / "third").mkdir(parents=True)
    (root / "site-packages" / "third" / "t.py").write_text("y = 1\n")
    (root / "bad.py").write_bytes(b"\xff\xfe not utf-8")
    (root / "notes.txt").write_text("not python")


def test_list_sources_rules(tmp_path: Path) -> None:
    _make_tree(tmp_path)
    files = list_sources(tmp_path)
    assert len(files) == 50 and all(f.startswith("pkg/") for f in files)


def test_split_deterministic_and_disjoint(tmp_path: Path) -> None:
    _make_tree(tmp_path)
    a, b = split_by_file(tmp_path, 0.1, seed=0), split_by_file(tmp_path, 0.1, seed=0)
    assert a == b
    assert len(a.heldout) == 5 and not set(a.train) & set(a.heldout)
    assert set(a.train) | set(a.heldout) == set(list_sources(tmp_path))
    assert split_by_file(tmp_path, 0.1, seed=1).heldout != a.heldout


def test_split_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_by_file(tmp_path, 1.5)
    with pytest.raises(FileNotFoundError):
        list_sources(tmp_path / "missing")
