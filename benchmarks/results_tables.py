"""Rewrite the moespec-base tables of docs/results.md and README.md from benchmarks/results/base/bench.md
(Table 1), so the quoted numbers are the committed run's (tests/test_readme.py checks they agree).

    python -m benchmarks.results_tables
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def table_1(path: Path) -> dict[str, list[tuple[str, str, str]]]:
    """{"0": [(method, per-data-set cells, mean)], "1": ...} from a bench.md's Table 1."""
    text = path.read_text()
    text = text[text.index("## Table 1"):text.index("## Table 2")]
    out = {}
    for temp, section in zip(("0", "1"), text.split("Temperature 1")):
        out[temp] = [m.groups() for m in re.finditer(r"^\| (\S+) \| (.+) \| ([\d.]+x) \|$", section, re.M)
                     if m[1] != "Method"]
    return out


def replace_rows(text: str, header: str, rows: list[str]) -> str:
    """The table under `header` (its header and separator lines kept) with `rows` as its body."""
    head = text.index(header)
    end = text.index("\n\n", head)
    kept = text[head:end].splitlines()[:2]
    return text[:head] + "\n".join(kept + rows) + text[end:]


def main() -> None:
    rows = table_1(REPO / "benchmarks/results/base/bench.md")
    results = (REPO / "docs/results.md").read_text()
    for temp in ("0", "1"):
        results = replace_rows(results, f"| T={temp} moespec-base tokens/s (x ar) |",
                               [f"| {name} | {cells} |" for name, cells, _ in rows[temp]])
    (REPO / "docs/results.md").write_text(results)
    readme = (REPO / "README.md").read_text()
    means = {name: mean for name, _, mean in rows["1"]}
    readme = replace_rows(readme, "| method (x ar, mean of 3 data sets) | T=0 | T=1 |",
                          [f"| {name} | {mean} | {means[name]} |" for name, _, mean in rows["0"]])
    (REPO / "README.md").write_text(readme)


if __name__ == "__main__":
    main()
