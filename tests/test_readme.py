"""The README and the docs pages quote the files they cite (shipped cost profile, committed benchmark
tables), the README's two commands are the ones .ci/run runs, and the README stays a front page."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200  # issue 28: the README is a front page; the rest lives in docs/


def _bench_table_1(path: str = "benchmarks/results/bench.md") -> dict[str, str]:
    """A bench.md's Table 1 (moespec-tiny's by default), split by temperature: {"0": ..., "1": ...}."""
    bench = (REPO / path).read_text()
    bench = bench[bench.index("## Table 1"):bench.index("## Table 2")]
    return {"0": bench.split("Temperature 1")[0], "1": bench.split("Temperature 1")[1]}


def test_quoted_step_costs_match_the_shipped_profile():
    models = (REPO / "docs/models.md").read_text()
    costs = json.loads((REPO / "trtllm_moespec/assets/moespec-tiny/cost_profile.json").read_text())["costs"]
    quoted = re.search(r"C\(0\) = (\d+) ms, C\(32\) = (\d+) ms", models)
    assert quoted, "docs/models.md no longer quotes C(0) and C(32)"
    assert (int(quoted[1]), int(quoted[2])) == (round(costs[0] * 1e3), round(costs[32] * 1e3))


@pytest.mark.parametrize("model, path", [("", "benchmarks/results/bench.md"),
                                         ("moespec-base ", "benchmarks/results/base/bench.md")])
def test_results_tables_match_the_committed_benchmark(model, path):
    results = (REPO / "docs/results.md").read_text()
    checked = 0
    for temp, section in _bench_table_1(path).items():
        head = results.index(f"| T={temp} {model}tokens/s (x ar) |")
        table = results[head:results.index("\n\n", head)].splitlines()[2:]
        assert len(table) >= 5, f"T={temp} results table is too short"
        for row in table:
            name, cells = re.fullmatch(r"\| (\S+) \| (.+) \|", row).groups()
            line = re.search(rf"^\| {re.escape(name)} \| (.+) \| [\d.]+x \|$", section, re.M)
            assert line and line[1] == cells, (temp, name, cells, line and line[1])
            checked += 1
    assert checked >= 10


def test_the_readme_headline_table_matches_the_benchmark_means():
    """The README's table quotes the default model's (moespec-base's) committed benchmark."""
    readme = (REPO / "README.md").read_text()
    head = readme.index("| method (x ar, mean of 3 data sets) | T=0 | T=1 |")
    rows = readme[head:readme.index("\n\n", head)].splitlines()[2:]
    sections = _bench_table_1("benchmarks/results/base/bench.md")
    assert len(rows) >= 7
    for row in rows:
        name, t0, t1 = re.fullmatch(r"\| (\S+) \| ([\d.]+x) \| ([\d.]+x) \|", row).groups()
        for temp, quoted in (("0", t0), ("1", t1)):
            mean = re.search(rf"^\| {re.escape(name)} \| .+ \| ([\d.]+x) \|$", sections[temp], re.M)
            assert mean and mean[1] == quoted, (temp, name, quoted, mean and mean[1])


def test_the_first_command_comes_with_the_loop_warning():
    readme = (REPO / "README.md").read_text()
    first = readme.index("moespec generate --max-tokens 48")
    assert "Expect loops" in readme[first:first + 600]
    assert "docs/bad_inputs.md" in readme


def test_the_two_commands_are_the_ones_ci_runs():
    readme = (REPO / "README.md").read_text()
    quick = readme[readme.index("## Quick start (two commands)"):]
    quick = quick[:quick.index("\n## ")]
    commands = re.findall(r"```bash\n(.+?)\n```", quick)
    assert len(commands) == 2, commands
    ci = (REPO / ".ci/run").read_text().replace(" --quiet", "")
    install, tests = commands
    assert install.startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    assert install.split(" && ", 2)[2] in ci  # .ci/run makes and activates the venv itself
    assert tests.startswith(". .venv/bin/activate && ") and tests.split(" && ", 1)[1] in ci


def test_the_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
