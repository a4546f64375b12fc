"""`benchmarks/bench_step_overhead.py` on moespec-tiny, eagle3 and joint: the compiled host work and the reference
decode the same tokens, and each variant's overhead is the sum of its parts (drafting bookkeeping, selection,
acceptance, commit, engine)."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import bench_step_overhead


@pytest.mark.parametrize("policy", ["eagle3", "joint"])
def test_overhead_is_split_into_its_parts(tmp_path, policy):
    pytest.importorskip("numba")
    out = tmp_path / "overhead.json"
    before = {k: os.environ.get(k) for k in bench_step_overhead.SWITCHES}
    bench_step_overhead.main(["--model", "moespec-tiny", "--policy", policy, "--tokens", "12", "--repeats", "1",
                              "--json", str(out)])
    assert {k: os.environ.get(k) for k in bench_step_overhead.SWITCHES} == before  # the switches are put back
    report = json.loads(out.read_text())
    assert report["model"] == "moespec-tiny" and report["policy"] == policy and report["tree"][2] > 0
    for name in bench_step_overhead.VARIANTS:
        v = report[name]
        assert v["verified_tokens"] > 0 and v["target_ms"] > 0 and v["drafter_forward_ms"] > 0
        parts = sum(v[p] for p in bench_step_overhead.PARTS)
        assert parts == pytest.approx(v["overhead_ms"], abs=1e-6)  # medians of single runs: exact
