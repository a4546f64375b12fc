"""benchmarks/guard_prior.py: the shipped guard prior is what the committed bench run measured, and writing it
keeps the file's other entries."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.guard_prior import derive, main
from trtllm_moespec.assets import shipped_model_paths
from trtllm_moespec.policy_defaults import PolicyDefaults

BENCH = Path(__file__).parents[2] / "benchmarks/results/base/bench.json"
SHIPPED = shipped_model_paths("moespec-base")["policy_defaults"]


def test_the_shipped_prior_is_derived_from_the_committed_bench(tmp_path, capsys):
    bench = json.loads(BENCH.read_text())
    shipped = PolicyDefaults.load(SHIPPED)
    assert derive(bench) == shipped.guard.sampled
    out = tmp_path / "policy_defaults.json"
    shutil.copy(SHIPPED, out)
    main([str(BENCH), "--out", str(out), "--method", "evict[guard=off,stop=off]"])
    written = PolicyDefaults.load(out)
    assert written.guard.sampled == derive(bench, "evict[guard=off,stop=off]") != shipped.guard.sampled
    assert (written.policies, written.values) == (shipped.policies, shipped.values)
    assert written.guard.tree == (6, 8, 32) and "evict[guard=off,stop=off]" in written.guard.record["derived_by"]


def test_a_bench_without_the_cells_is_named():
    bench = json.loads(BENCH.read_text())
    with pytest.raises(ValueError, match=r"no 'nope' cell at T=1.0"):
        derive(bench, "nope")
    no_ar = dict(bench, results=[r for r in bench["results"] if r["method"] != "ar"])
    with pytest.raises(ValueError, match="no 'ar' cell at T=1.0 for gsm8k, humaneval, mt_bench"):
        derive(no_ar)
