"""Replay: records round-trip, and replaying the live policy on its own records reproduces the
live selections and accepted counts step for step (moespec-tiny, greedy, a few steps)."""

from __future__ import annotations

import pytest
import torch

from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.cli import main as cli_main
from trtllm_moespec.core.cost import CostTable
from trtllm_moespec.core.policies import make_policy
from trtllm_moespec.core.values import RawValues
from trtllm_moespec.replay.record import record
from trtllm_moespec.replay.records import ReplayFile
from trtllm_moespec.replay.score import StepCost, live_agreement, oracle_selection, realized_accepts, replay_policy
from trtllm_moespec.resolve import resolve_model

PROMPT = "def add(a, b):\n"
PARAMS = SamplingParams(max_tokens=20)


@pytest.fixture(scope="module", params=[("joint", "calibrated"), ("evict", "raw")])
def recorded(request, tmp_path_factory):
    torch.set_num_threads(1)
    policy, values = request.param
    llm = LLM(policy=policy, values=values)
    ids = llm.encode(PROMPT)
    records, outputs = record(llm, ids, [PARAMS], {"model": "moespec-tiny", "tree": [4, 8, 32]})
    path = records.save(tmp_path_factory.mktemp("replay") / "r.safetensors")
    return llm, ReplayFile.load(path), outputs[0]


def test_recording_does_not_change_the_live_run(recorded):
    llm, records, output = recorded
    assert output == llm.generate([PROMPT], PARAMS)[0].token_ids
    assert records.num_steps >= 3
    # Every live accepted count is a prefix of the recorded true chain.
    for s in range(records.num_steps):
        step = records.step(s)
        _, chain = realized_accepts(step, list(range(step.tree.num_nodes)), None)
        assert step.live_num_accepted <= len(chain)


def test_replay_of_the_live_policy_agrees_with_live_decoding(recorded):
    llm, records, _ = recorded
    cost = StepCost(CostTable.load(resolve_model("moespec-tiny").cost_profile, override=True), use_fit=True)
    model = llm.engine.values if llm.engine.values is not None else RawValues()
    same, total = live_agreement(records, llm.policy, model, cost, 32)
    assert same == total, f"replay differs from live decoding on {total - same} of {total} steps"


def test_oracle_selection_is_the_best_chain_prefix(recorded):
    llm, records, _ = recorded
    cost = StepCost(CostTable(tuple(1.0 + 0.01 * k for k in range(33))), use_fit=False)
    oracle, _ = replay_policy(records, "oracle", None, None, cost, 32)
    for s in range(records.num_steps):
        step = records.step(s)
        _, chain = realized_accepts(step, list(range(step.tree.num_nodes)), None)
        assert oracle_selection(step, cost, 32) == chain  # cheap nodes: verify the whole accepted chain
    eagle, _ = replay_policy(records, "eagle3", make_policy("eagle3", budget=32), None, cost, 32)
    assert oracle.tokens >= eagle.tokens and oracle.tokens / oracle.cost_s >= eagle.tokens / eagle.cost_s


def test_bad_replay_files_fail_cleanly(tmp_path, capsys):
    assert cli_main(["replay", "score", str(tmp_path / "missing.safetensors")]) == 2
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    assert cli_main(["replay", "rank", str(tmp_path / "bad.safetensors")]) == 2
    assert "error" in capsys.readouterr().err
