"""Run the lossless tests under every mutant; exit 1 unless each mutant is killed by every group.

    python -m tests.mutants -j 2             # CI: each mutant against each group, stopping at the first failure
    python -m tests.mutants --mutant T2      # one mutant
    python -m tests.mutants --table          # every test under every mutant: which tests kill which (slow)

A group is killed when pytest reports failed tests (exit status 1) and the mutant was exercised
(it changed what the verifier did at least once); a passing group, a mutant never exercised or any
other exit status (collection error, crash) fails the check. The groups are the core rule's tests
and the engine-level tests, so a test change that stops the engine from accepting drafts (as
`max_tokens=2` did) is caught even while the core tests still bite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.mutants.mutants import MUTANTS

REPO = Path(__file__).resolve().parents[2]

# Per group, the tests of each kind of mutant; a mutant's own kind runs first, fastest killers first,
# and the CI run stops at the first failing test. Test ids are pytest node ids (a bare function name
# runs all its parameters).
GROUPS: dict[str, dict[str, tuple[str, ...]]] = {
    "core": {
        "sampled": ("tests/core/test_verify.py::test_sampling_distribution_matches_an_independent_target_law",
                    "tests/core/test_verify.py::test_vectorised_equals_reference_with_the_same_uniforms",
                    "tests/core/test_seeded_sampling.py::test_seeded_sampling_follows_an_independent_target_law_with_drafts_accepted",
                    "tests/core/test_seeded_sampling.py::test_every_tree_emits_the_tokens_plain_decoding_emits"),
        "greedy": ("tests/core/test_verify.py::test_greedy_verification_follows_the_argmax_chain",
                   "tests/core/test_verify.py::test_host_greedy_walk_equals_the_tensor_path"),
    },
    "engine": {
        "sampled": ("tests/engine/test_sampling.py::test_temperature_and_top_p_follow_an_independent_target_law",
                    "tests/engine/test_sampling.py::test_first_tokens_match_target_distribution",
                    "tests/engine/test_logit_rules.py::test_sampled_tokens_follow_the_penalized_distribution",
                    "tests/engine/test_logit_rules.py::test_min_p_greedy_is_unchanged_and_sampling_follows_the_filtered_distribution",
                    "tests/engine/test_structured.py::test_sampled_tokens_follow_the_masked_distribution",
                    "tests/engine/test_guard.py::test_sampling_distribution_with_plain_and_speculative_steps",
                    "tests/engine/test_batch.py::test_joint_batch_sampling_keeps_the_target_distribution",
                    "tests/engine/test_seeded.py::test_every_policy_alone_and_batched_gives_the_text_ar_gives"),
        "greedy": ("tests/engine/test_tiny_model.py::test_every_policy_is_exact_and_speculates_on_the_shipped_model",
                   "tests/engine/test_exactness.py"),
    },
}


def targets(mutant: str, group: str) -> tuple[str, ...]:
    """The group's tests, those for the mutant's kind first."""
    kind = MUTANTS[mutant].kind
    return GROUPS[group][kind] + tuple(t for k, tests in GROUPS[group].items() if k != kind for t in tests)


def run_group(name: str | None, group: str, tests: tuple[str, ...], stop_first: bool) -> dict:
    """pytest on `tests` under mutant `name` (None: unmutated); returns its verdict and timings."""
    with tempfile.TemporaryDirectory() as tmp:
        report, junit = Path(tmp) / "hits", Path(tmp) / "junit.xml"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MOESPEC_MUTANT_REPORT": str(report)}
        if name:
            env["MOESPEC_MUTANT"] = name
        cmd = [sys.executable, "-m", "pytest", "-p", "tests.mutants.plugin", "-q", "-p", "no:cacheprovider",
               "-p", "no:xdist", f"--junitxml={junit}", *(["-x"] if stop_first else []), *tests]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        hits = sum(sum(json.loads(f.read_text()).values()) for f in report.glob("*.json")) if report.is_dir() else 0
        failed = _failed_tests(junit) if junit.is_file() else []
    killed = proc.returncode == 1 and hits > 0 and bool(failed)
    return {"mutant": name, "group": group, "rc": proc.returncode, "hits": hits, "failed": failed,
            "killed": killed, "seconds": round(seconds, 1), "tail": "" if killed else proc.stdout[-2000:]}


def _failed_tests(junit: Path) -> list[str]:
    """Names of the failed test cases in a junit XML report."""
    root = ET.parse(junit).getroot()
    return [f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}" for case in root.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__.splitlines()[0])
    parser.add_argument("--mutant", action="append", choices=sorted(MUTANTS), help="only these mutants")
    parser.add_argument("--group", action="append", choices=sorted(GROUPS), help="only these groups")
    parser.add_argument("--table", action="store_true", help="run every test of a group (no -x): the kill table")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="pytest runs at once (each single-process)")
    args = parser.parse_args(argv)
    names = args.mutant or list(MUTANTS)
    groups = args.group or list(GROUPS)
    runs = [(name, group) for name in names for group in groups]
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        futures = [pool.submit(run_group, n, g, targets(n, g), not args.table) for n, g in runs]
        results = []
        for (name, group), future in zip(runs, futures):
            r = future.result()
            results.append(r)
            verdict = "killed" if r["killed"] else "SURVIVED" if r["rc"] == 0 else f"ERROR (rc {r['rc']}, hits {r['hits']})"
            print(f"{name:>17} | {group:<6} | {verdict:<8} | exercised {r['hits']:>6} | {r['seconds']:>6.1f} s | "
                  f"{', '.join(r['failed']) or '-'}", flush=True)
            if not r["killed"]:
                print(r["tail"], flush=True)
    survivors = [f"{r['mutant']}/{r['group']}" for r in results if not r["killed"]]
    print(json.dumps({"mutants": names, "groups": groups, "survived_or_error": survivors,
                      "seconds": round(sum(r["seconds"] for r in results), 1)}))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
