"""benchmarks/batch_guard_ab.py: one tiny served run through every arm, texts checked against ar's."""

import json

import pytest

from benchmarks.batch_guard_ab import ARMS, main


def test_a_tiny_run_reports_every_arm_at_every_batch_size(tmp_path):
    out = tmp_path / "ab.json"
    result = main(["--model", "moespec-tiny", "--batch-sizes", "1,2", "--requests", "3", "--tokens", "8",
                   "--repeats", "1", "--json", str(out)])
    cells = {(c["arm"], c["batch"]): c for c in result["cells"]}
    assert set(cells) == {(a, b) for a in ARMS for b in (1, 2)}
    assert all(c["exact"] and c["tokens_per_s"] > 0 for c in cells.values())  # greedy: every arm's text is ar's
    assert cells["ar", 1]["vs_ar"] == 1.0 and cells["ar", 1]["speculative_share"] == 0.0
    assert cells["off", 2]["speculative_share"] > 0.0  # without a guard the batch drafts every step and verifies
    assert json.loads(out.read_text())["cells"] == result["cells"]


def test_arms_and_policy_are_checked():
    with pytest.raises(SystemExit):
        main(["--arms", "default,off"])  # no ar to compare with
    with pytest.raises(SystemExit):
        main(["--policy", "joint"])  # a guard handed to the engine applies to batch policies only
