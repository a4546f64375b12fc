"""pytest plugin: with MOESPEC_MUTANT=<name> set, install that mutant for the whole session (before
collection, so test modules see it too) and write how often it was exercised to
MOESPEC_MUTANT_REPORT/<pid>.json at the end. Without the variable it does nothing.

    MOESPEC_MUTANT=takedraft python -m pytest -p tests.mutants.plugin tests/engine/test_sampling.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

_patcher: pytest.MonkeyPatch | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _patcher
    name = os.environ.get("MOESPEC_MUTANT")
    if not name:
        return
    from tests.mutants.mutants import MUTANTS

    if name not in MUTANTS:
        raise pytest.UsageError(f"MOESPEC_MUTANT={name!r} is not a mutant; known: {', '.join(MUTANTS)}")
    _patcher = pytest.MonkeyPatch()
    MUTANTS[name].apply(_patcher)


def pytest_unconfigure(config: pytest.Config) -> None:
    global _patcher
    if _patcher is None:
        return
    from tests.mutants.mutants import HITS

    report = os.environ.get("MOESPEC_MUTANT_REPORT")
    if report:
        Path(report).mkdir(parents=True, exist_ok=True)
        (Path(report) / f"{os.getpid()}.json").write_text(json.dumps(dict(HITS)))
    _patcher.undo()
    _patcher = None
