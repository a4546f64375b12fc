"""`benchmarks/gpu_check.sh --cpu-smoke` runs end to end on the CPU, so the GPU script cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_cpu_smoke(tmp_path):
    # Generous timeouts: a shared CI CPU is far slower than the GPU machine the defaults are sized for.
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, TEST_TIMEOUT="900", MEASURE_TIMEOUT="900")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu-smoke"], env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["cpu_smoke"] is True
    assert {r["mode"] for r in result["select_tree"]} == {"evict", "ecospec", "joint"}
    assert result["ar"]["lean_tokens_per_s"] > 0 and result["ar"]["transformers_generate_tokens_per_s"] > 0
    assert [r["k"] for r in result["cost"]["rows"]] == [0, 1, 2, 4, 8, 16, 32]
    assert all(r["eager_ms"] > 0 and r["graph_ms"] > 0 for r in result["cost"]["rows"])
    assert "tests kernels: exit" in proc.stdout and "tests engine: exit" in proc.stdout
    sweep = result["batch_sweep"]
    assert {(r["batch"], r["method"]) for r in sweep["rows"]} == {(b, m) for b in (1, 2, 4, 8)
                                                                  for m in ("ar", "eagle3", "joint-batch")}
    assert all(r["exact"] and r["tokens_per_s"] > 0 for r in sweep["rows"]) and sweep["skipped_batch_sizes"] == []
    assert "batch sweep" in proc.stdout and "joint-batch" in proc.stdout
    # the sync count ran its speculative steps (CPU tensors never synchronise: nothing is counted)
    assert [r["policy"] for r in result["host_syncs"]] == ["eagle3", "evict", "joint"]
    assert all(r["steps"] > 0 and r["max"] == 0 for r in result["host_syncs"])


def test_batch_sweep_flags_a_request_that_differs(monkeypatch):
    """The exactness check can fail: a batched run whose last request's tokens differ from its
    single-request ar output is recorded as not exact (and the script would exit 1)."""
    from benchmarks import gpu_check
    from trtllm_moespec.engine.batch import BatchedEngine

    run_all = BatchedEngine.run_all

    def corrupted(self, requests):
        run_all(self, requests)
        requests[-1].output_ids[-1] = (requests[-1].output_ids[-1] + 1) % 256

    monkeypatch.setattr(BatchedEngine, "run_all", corrupted)
    sweep = gpu_check.batch_sweep(torch.device("cpu"), tokens=3, repeats=1, budget_s=60, batch_sizes=(2,),
                                  methods=("ar",))
    assert [(r["batch"], r["exact"]) for r in sweep["rows"]] == [(2, False)]
    passing = dict(select_tree=[], ar={}, graph_speed=[], cost={}, batch_sweep=dict(sweep, rows=[]), host_syncs=[])
    assert gpu_check.passed(passing)
    assert not gpu_check.passed(dict(passing, batch_sweep=sweep))
    assert not gpu_check.passed(dict(passing, cost=dict(error="RuntimeError: CUDA error")))


def test_batch_sweep_skips_batch_sizes_past_its_budget():
    from benchmarks import gpu_check

    sweep = gpu_check.batch_sweep(torch.device("cpu"), tokens=2, repeats=1, budget_s=0.0, batch_sizes=(1, 2),
                                  methods=("ar",))
    assert sweep["rows"] == [] and sweep["skipped_batch_sizes"] == [1, 2]


def test_a_failing_section_is_recorded_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    from benchmarks import gpu_check

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access")

    # The harness is under test here, not the measurements: every section but the broken one is a
    # cheap stand-in of the right shape.
    monkeypatch.setattr(gpu_check, "select_timings", broken)
    monkeypatch.setattr(gpu_check, "ar_tokens_per_s", lambda *a, **k: dict(
        lean_tokens_per_s=1.0, transformers_generate_tokens_per_s=1.0, ratio=1.0))
    monkeypatch.setattr(gpu_check, "graph_speed", lambda *a, **k: [])
    monkeypatch.setattr(gpu_check, "cost_table", lambda *a, **k: dict(prefix=1, dtype="f32", build_s=0.0,
                                                                      graphs=False, rows=[]))
    monkeypatch.setattr(gpu_check, "batch_sweep", lambda *a, **k: dict(tokens=1, rows=[], skipped_batch_sizes=[],
                                                                       budget_s=0.0))
    monkeypatch.setattr(gpu_check, "host_syncs", lambda *a, **k: [])
    result = gpu_check.main(["--out", str(tmp_path), "--cpu-smoke"])
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["select_tree"] == {"error": "RuntimeError: CUDA error: an illegal memory access"}
    assert set(saved["section_s"]) == {"select_tree", "ar", "graph_speed", "cost", "batch_sweep", "host_syncs"}
    assert "select_tree: FAILED (RuntimeError" in capsys.readouterr().out
    assert not gpu_check.passed(result)
