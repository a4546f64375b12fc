"""`benchmarks/gpu_check.sh --cpu-smoke` runs end to end on the CPU, so the GPU script cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
