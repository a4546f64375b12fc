"""`benchmarks/bench_c0_overhead.py` on moespec-tiny: C(0) steps draft and verify the root alone, plain steps
draft nothing, and the overhead is C(0) less the plain step and the drafter forwards timed in the C(0) steps."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_c0_overhead


def test_c0_steps_draft_and_verify_the_root_alone(tmp_path):
    out = tmp_path / "c0.json"
    bench_c0_overhead.main(["--model", "moespec-tiny", "--steps", "6", "--json", str(out)])
    r = json.loads(out.read_text())
    c0, plain = r["c0"], r["plain"]
    assert c0["speculated"] == 1 and c0["verified_tokens"] == 0 and c0["drafter_forward_ms"] > 0
    assert plain["speculated"] == 0 and plain["drafter_forward_ms"] == 0  # the plain step defers its drafter
    assert c0["drafting_bookkeeping_ms"] > 0 and c0["target_ms"] > 0
    assert r["overhead_ms"] == pytest.approx(c0["step_ms"] - plain["step_ms"] - c0["drafter_forward_ms"])
    assert r["model"] == "moespec-tiny" and r["goal_overhead_ms"] == 1.0
