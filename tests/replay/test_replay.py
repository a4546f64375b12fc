"""Replay: records round-trip, and replaying the live policy on its own records reproduces the
live selections and accepted counts step for step (moespec-tiny, greedy, a few steps)."""

from __future__ import annotations

import json

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


@pytest.fixture(scope="module", params=[("joint", "calibrated"), ("evict", "raw"), ("ecospec", "calibrated")])
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


def test_records_keep_every_drafted_node_while_expert_aware_policies_choose_among_their_candidates(recorded):
    """ecospec predicts experts for its top candidates by value only (`SpecEngine.candidates`), but the
    record keeps the whole drafted tree, with predicted experts for every node: a policy replayed on it
    chooses among what it would see live, not among what the recording policy was cut to."""
    llm, records, _ = recorded
    m = llm.policy.candidate_count(32)
    step = records.step(0)
    drafted = int(step.tree.valid.sum())
    assert drafted > 2 * 16  # tiny's [4, 8, 32] tree drafts ~200 nodes
    if m is None:
        return
    assert m < drafted
    predicted = int((step.experts.bits[0] != 0).any(-1).sum())
    assert predicted == drafted  # the candidates' live predictions and the expert source's for the rest
    assert len(step.live_selected) <= m


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


def test_the_calibrator_prior_counts_only_nodes_whose_parent_the_target_accepts(recorded, tmp_path):
    """c(v) is P(accept v | parent accepted): a node under a rejected parent is no trial (the fit once
    counted every node, which made deep low-rank nodes look 5x likelier than live and copies unlikelier)."""
    from trtllm_moespec.core.values import Calibrator
    from trtllm_moespec.replay.score import true_values

    _, records, _ = recorded
    path = tmp_path / "records.safetensors"
    records.save(path)
    out = tmp_path / "cal.json"
    assert cli_main(["replay", "fit-calibrator", str(path), "--out", str(out)]) == 0
    trials, accepted = Calibrator.load(out).tables[0].arrays()
    expected_trials = expected_hits = 0
    for s in range(records.num_steps):
        step = records.step(s)
        truth = true_values(step)[0] > 0.5  # T=0: the target's chain
        for v in range(step.tree.num_nodes):
            parent = int(step.tree.parents[0, v])
            if bool(step.tree.valid[0, v]) and (parent < 0 or bool(truth[parent])):
                expected_trials += 1
                expected_hits += int(truth[v])
    assert expected_trials < sum(int(records.step(s).tree.valid.sum()) for s in range(records.num_steps))
    assert trials.sum() == pytest.approx(expected_trials)
    assert accepted.sum() == pytest.approx(expected_hits)


def test_hindsight_prefix_bounds_the_stop_rule_and_the_oracle_bounds_it(recorded):
    """Per step, the best prefix of a value order (hindsight) earns at least the policy's own stop on that
    order, and the oracle (the true order) at least as much as any prefix of another order."""
    _, records, _ = recorded
    cost = StepCost(CostTable.load(resolve_model("moespec-tiny").cost_profile, override=True), use_fit=True)
    evict = make_policy("evict", budget=32, cost_table=cost.table)
    _, own = replay_policy(records, "evict", evict, RawValues(), cost, 32)
    _, bound = replay_policy(records, "hindsight", evict, RawValues(), cost, 32, hindsight=True)

    def ratio(step, sel):
        return (1.0 + realized_accepts(step, sel, None)[0]) / cost(step, sel)

    strict = 0
    for s, (mine, best) in enumerate(zip(own, bound)):
        step = records.step(s)
        assert ratio(step, best) >= ratio(step, mine) - 1e-12
        assert ratio(step, oracle_selection(step, cost, 32)) >= ratio(step, best) - 1e-12
        strict += ratio(step, best) > ratio(step, mine) + 1e-12
    assert strict > 0  # the bound is not the policy itself


def test_tune_keeps_the_best_replayed_value_and_writes_it_beside_other_policies(recorded, tmp_path, capsys):
    """`replay tune` scores each candidate as `replay_policy` does (the same tokens and costs), keeps the best
    mean speedup, and an existing defaults file keeps its other policies' entries."""
    import json

    from trtllm_moespec.policy_defaults import PolicyDefaults

    _, records, _ = recorded
    path, out, report = tmp_path / "r.safetensors", tmp_path / "policy_defaults.json", tmp_path / "tune.json"
    records.save(path)
    grid = (1, 2, 4, 32)
    assert cli_main(["replay", "tune", str(path), "--policy", "eagle3", "--grid", ",".join(map(str, grid)),
                     "--out", str(out), "--json", str(report)]) == 0
    table = CostTable.load(resolve_model("moespec-tiny").cost_profile, override=True)
    cost = StepCost(table, use_fit=True)
    scored = json.loads(report.read_text())["grid"]
    for point, budget in zip(scored, grid):
        tally, _ = replay_policy(records, "eagle3", make_policy("eagle3", budget=budget), None, cost, 32)
        assert point["speedup"] == {"r:all": pytest.approx(tally.tokens / tally.cost_s * table.plain_step, abs=1e-4)}
    best = max(scored, key=lambda p: p["mean_speedup"])["value"]
    assert len({p["mean_speedup"] for p in scored}) > 1  # the candidates differ: the choice means something
    assert cli_main(["replay", "tune", str(path), "--policy", "ecospec", "--grid", "2,3", "--out", str(out)]) == 0
    tuned = PolicyDefaults.load(out)
    assert tuned.model_id == "moespec-tiny" and set(tuned.policies) == {"eagle3", "ecospec"}
    assert tuned.policies["eagle3"].options == {"budget": best}
    assert tuned.policies["eagle3"].tree == tuple(records.meta["tree"])
    assert cli_main(["replay", "tune", str(path), "--policy", "coverage", "--option", "rho", "--grid", "0.5,0.9",
                     "--out", str(out)]) == 0  # a float option
    assert PolicyDefaults.load(out).policies["coverage"].options["rho"] in (0.5, 0.9)
    with pytest.raises(SystemExit) as refused:  # argparse: one line, exit 2
        cli_main(["replay", "tune", str(path), "--grid", "3,many"])
    assert refused.value.code == 2
    capsys.readouterr()


def test_tune_groups_steps_by_the_data_set_of_their_prompt(recorded):
    from dataclasses import replace

    from trtllm_moespec.replay.tune import dataset_steps

    _, records, _ = recorded
    assert dataset_steps(records) == {"all": list(range(records.num_steps))}  # no prompt names recorded
    named = replace(records, meta={**records.meta, "prompts": ["gsm8k:7"]})
    assert dataset_steps(named) == {"gsm8k": list(range(records.num_steps))}


def test_true_experts_replays_a_perfect_predictor(recorded, tmp_path):
    """`--true-experts` scores an expert-aware policy as if its predictor had recorded the target's own routing:
    the same selections as on a copy of the records whose predictions are the true sets, which differ from the
    recorded predictions' on some steps; the CLI adds a row per expert-aware policy."""
    llm, records, _ = recorded
    if not llm.policy.reads_experts:
        pytest.skip("the recording policy predicted no expert sets")
    cost = StepCost(CostTable.load(resolve_model("moespec-tiny").cost_profile, override=True), use_fit=True)
    policy = make_policy("ecospec", budget=4)
    a = records.arrays
    perfect = ReplayFile({**a, "pred_experts": a["true_experts"], "root_pred_experts": a["root_true_experts"]},
                         records.meta)
    _, true = replay_policy(records, "ecospec", policy, RawValues(), cost, 32, true_experts=True)
    _, copied = replay_policy(perfect, "ecospec", policy, RawValues(), cost, 32)
    _, predicted = replay_policy(records, "ecospec", policy, RawValues(), cost, 32)
    assert true == copied
    assert true != predicted
    out = tmp_path / "score.json"
    saved = records.save(tmp_path / "r.safetensors")
    assert cli_main(["replay", "score", str(saved), "--policies", "evict,ecospec", "--values", "raw",
                     "--true-experts", "--json", str(out)]) == 0
    labels = [r["label"] for r in json.loads(out.read_text())["results"]]
    assert "ecospec[values=raw,experts=true]" in labels and "ecospec[values=raw]" in labels
    assert not any(label.startswith("evict") and "experts=true" in label for label in labels)
