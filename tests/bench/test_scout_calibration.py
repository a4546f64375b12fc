"""benchmarks/scout_calibration.py: the windows it compares, predicted by the guard's own rule."""

import numpy as np

from benchmarks.scout_calibration import window_pairs
from trtllm_moespec.engine.guard import SCOUT_MIN


def test_each_window_pairs_the_guards_prediction_with_the_next_windows_steps():
    ranks = np.array([0] * 12 + [5] * 4 + [0] * 16)  # 12 of the first 16 committed tokens in the drafter's top 2
    steps = [4] * 4 + [2] * 8  # tokens per speculative step: 16 positions in 4 steps, then 16 in 8
    pairs = window_pairs(ranks, steps, top=2, depth=2, window=16)
    assert pairs[0] == (1 + 0.75 + 0.75 ** 2, 2.0)  # the window after holds the 2-token steps
    assert len(pairs) == 2 and pairs[1][1] == 2.0  # windows start every 8 positions while steps follow
    assert window_pairs(ranks, steps, top=2, depth=2, window=SCOUT_MIN - 1) == []  # too few hits to judge
