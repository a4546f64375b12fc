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


def test_results_tables_match_the_committed_benchmark():
    readme = (REPO / "README.md").read_text()
    bench = (REPO / "benchmarks/results/bench.md").read_text()
    bench = bench[bench.index("## Table 1"):bench.index("## Table 2")]
    sections = {"0": bench.split("Temperature 1")[0], "1": bench.split("Temperature 1")[1]}
    checked = 0
    for temp, section in sections.items():
        head = readme.index(f"| T={temp} tokens/s (x ar) |")
        table = readme[head:readme.index("\n\n", head)].splitlines()[2:]
        assert len(table) >= 5, f"T={temp} results table is too short"
        for row in table:
            name, cells = re.fullmatch(r"\| (\S+) \| (.+) \|", row).groups()
            line = re.search(rf"^\| {re.escape(name)} \| (.+) \| [\d.]+x \|$", section, re.M)
            assert line and line[1] == cells, (temp, name, cells, line and line[1])
            checked += 1
    assert checked >= 10


def test_the_first_command_comes_with_the_loop_warning():
    readme = (REPO / "README.md").read_text()
    first = readme.index("moespec generate --max-tokens 48")
    assert "Expect loops" in readme[first:first + 600]
    assert "docs/bad_inputs.md" in readme
