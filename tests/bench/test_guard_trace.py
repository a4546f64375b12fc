"""benchmarks/guard_trace.py: the step traces it prints, and one tiny run through every variant."""

from types import SimpleNamespace

from benchmarks.guard_trace import VARIANTS, main, trace


def test_trace_marks_plain_steps_and_committed_tokens():
    steps = [SimpleNamespace(speculated=s, committed_tokens=c) for s, c in ((True, 3), (False, 1), (True, 12))]
    assert trace(steps) == "3.9"


def test_a_tiny_run_reports_every_variant(capsys):
    rates = main(["--model", "moespec-tiny", "--variants", ",".join(VARIANTS), "--datasets", "humaneval",
                  "--prompts", "1", "--tokens", "8"])
    assert set(rates) == set(VARIANTS) and all(r > 0 for r in rates.values())
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("humaneval")]
    assert len(lines) == len(VARIANTS)
