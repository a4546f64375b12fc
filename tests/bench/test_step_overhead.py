"""`benchmarks/bench_step_overhead.py` on moespec-tiny: both drafting paths decode the same tokens, and each
variant's overhead is the sum of its parts (drafting bookkeeping, selection, acceptance, commit, engine)."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import bench_step_overhead


def test_overhead_is_split_into_its_parts(tmp_path):
    pytest.importorskip("numba")
    out = tmp_path / "overhead.json"
    before = os.environ.get("MOESPEC_FUSED_DRAFT")
    bench_step_overhead.main(["--model", "moespec-tiny", "--tokens", "12", "--repeats", "1", "--json", str(out)])
    assert os.environ.get("MOESPEC_FUSED_DRAFT") == before  # the switch is put back
    report = json.loads(out.read_text())
    assert report["model"] == "moespec-tiny" and report["tree"][2] > 0
    for name in bench_step_overhead.VARIANTS:
        v = report[name]
        assert v["verified_tokens"] > 0 and v["target_ms"] > 0 and v["drafter_forward_ms"] > 0
        parts = sum(v[p] for p in bench_step_overhead.PARTS)
        assert parts == pytest.approx(v["overhead_ms"], abs=1e-6)  # medians of single runs: exact
