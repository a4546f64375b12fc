"""The shipped moespec-base family (the deployment cost regime): what it must hold (issue 25), and
every policy exact against transformers' greedy generate, speculating."""

from __future__ import annotations

import json

import pytest

from tests.engine.conftest import hf_greedy_references
from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.assets import shipped_model_paths
from trtllm_moespec.core.cost import CostTable, expert_term_pays

PROMPTS = ["def add(a, b):\n    ", "import os\n\nclass Config:\n"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def paths():
    return shipped_model_paths("moespec-base")  # FileNotFoundError (a failure) when the assets are missing


def test_the_shipped_family_is_complete_and_in_the_regime(paths):
    config = json.loads((paths["target"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["num_local_experts"] >= 32 and config["num_experts_per_tok"] >= 4 and config["mlp_only_layers"] == []
    assert (paths["target"] / "model.safetensors").stat().st_size <= 96 * 2**20
    for key in ("draft", "predictor_head"):  # the EAGLE-3 drafter and our draft-head expert predictor
        assert (paths[key] / "config.json").is_file(), key
    assert paths["calibrator"].is_file()
    from trtllm_moespec.models.acceptance_head import AcceptanceHead

    head = AcceptanceHead.load(paths["acceptance_head"])  # reads the shipped drafter's hidden, the target's tokens
    drafter = json.loads((paths["draft"] / "config.json").read_text())
    assert (head.config.hidden_size, head.config.vocab_size) == (drafter["hidden_size"], config["vocab_size"])
    profile = json.loads((paths["target"].parent / "cost_profile.json").read_text())
    assert profile["model_id"] == "moespec-base" and profile["expert_model"]
    # the deployment regime, not moespec-tiny's 0.22: the bound is 1/10 (goal 1/16; measured 0.050)
    assert profile["draft_forward"] <= profile["plain_step"] / 10
    assert profile["costs"][8] >= 2 * profile["plain_step"]  # verified nodes wake experts in every layer


@pytest.fixture(scope="module")
def references(paths):
    return hf_greedy_references(paths["target"], PROMPTS, MAX_TOKENS)


def test_the_shipped_profile_turns_joints_expert_term_off(paths):
    """On this CPU a woken expert costs ~20 us at a fixed verified count: choosing nodes by their experts
    can move a step by ~1 ms while the predictor and greedy cost ~1.4 ms, so joint selects as evict."""
    table = CostTable.load(paths["target"].parent / "cost_profile.json")
    pays, why = expert_term_pays(table)
    assert not pays and table.expert_model.expert_saving < table.expert_overhead, why
    llm = LLM("moespec-base")
    assert llm.policy.name == "joint" and not llm.policy.reads_experts and llm.engine.predictor is None


@pytest.mark.parametrize("policy", ["ar", "eagle3", "ddd", "coverage", "evict", "ecospec", "joint", "joint+experts",
                                    "joint+head"])
def test_every_policy_is_exact_on_moespec_base(references, policy):
    """Greedy output equals transformers'; the speculative policies accept drafts (guard off, so each
    step speculates: what is checked is the verification of selected trees, not plain steps).
    joint+experts: joint with its expert term forced on (the draft-head predictor runs); joint+head: joint
    ranking on the shipped acceptance head's values."""
    options = {"joint+experts": {"policy_options": {"expert_term": True}}, "joint+head": {"values": "head"}}.get(policy, {})
    llm = LLM("moespec-base", policy=policy.split("+")[0], guard="off", **options)
    assert llm.engine.predictor is not None or policy != "joint+experts"
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    accepted = sum(s.accepted_tokens for out in outs for s in out.steps)
    for out, ref in zip(outs, references):
        assert out.token_ids == ref
    if policy == "ar":
        assert accepted == 0
    else:
        assert accepted >= MAX_TOKENS // 2, f"{policy} accepted {accepted} draft tokens"
