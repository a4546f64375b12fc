"""The README's numbers match the files they quote (shipped cost profile, committed benchmark tables)."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_quoted_step_costs_match_the_shipped_profile():
    readme = (REPO / "README.md").read_text()
    costs = json.loads((REPO / "trtllm_moespec/assets/moespec-tiny/cost_profile.json").read_text())["costs"]
    quoted = re.search(r"C\(0\) = (\d+) ms, C\(32\) = (\d+) ms", readme)
    assert quoted, "the README no longer quotes C(0) and C(32)"
    assert (int(quoted[1]), int(quoted[2])) == (round(costs[0] * 1e3), round(costs[32] * 1e3))


def test_results_table_matches_the_committed_benchmark():
    readme = (REPO / "README.md").read_text()
    bench = (REPO / "benchmarks/results/bench.md").read_text().split("Temperature 1")[0]
    rows = re.findall(r"^\| (ar|lookahead \(n-gram\)|eagle3|evict|ecospec|joint) \| (.+) \|$", readme, re.M)
    assert len(rows) == 6
    for method, cells in rows:
        name = "lookahead" if method.startswith("lookahead") else method
        line = re.search(rf"^\| {name} \| (.+) \| [\d.]+x \|$", bench, re.M)
        assert line and line[1] == cells, (method, cells, line and line[1])


def test_the_first_command_comes_with_the_loop_warning():
    readme = (REPO / "README.md").read_text()
    first = readme.index("moespec generate --max-tokens 48")
    assert "Expect loops" in readme[first:first + 600]
    assert "docs/bad_inputs.md" in readme
