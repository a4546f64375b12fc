"""A selection must reach the target forward: on CPU the verify runs over the root and the selected
nodes only, not over the policy's fixed-width selection padded with -1. (It used to: every padded
position cost a full token of target compute, so evict, ecospec and joint paid for all 32 nodes
whatever they selected; on moespec-base a step of 7 selected nodes cost as much as eagle3's 32.)"""

from __future__ import annotations

import pytest

from trtllm_moespec import LLM, SamplingParams

PROMPT = "def add(a, b):\n    "


@pytest.mark.parametrize("policy", ["evict", "ecospec", "joint"])
def test_the_verify_forward_holds_only_the_selected_nodes(policy):
    llm = LLM("moespec-tiny", policy=policy, guard="off")
    target, widths = llm.engine.target, []
    verify = target.verify

    def spy(cache, layout):  # the real verify, its layout recorded
        widths.append((layout.num_positions, int(layout.num_nodes.max())))
        return verify(cache, layout)

    target.verify = spy
    out = llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert sum(s.accepted_tokens for s in out.steps) > 0
    assert widths and all(positions == 1 + nodes for positions, nodes in widths), widths
    assert [nodes for _, nodes in widths] == [s.verified_tokens for s in out.steps]
    assert min(positions for positions, _ in widths) < 1 + 32  # the policy selects fewer than the whole tree
