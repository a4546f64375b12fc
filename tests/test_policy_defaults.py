"""A model's tuned policy options (policy_defaults.json): applied where the user set none, for the tree and
device they were tuned on only, and a broken file named before anything loads."""

from __future__ import annotations

import json

import pytest

from trtllm_moespec.assets import shipped_model_paths
from trtllm_moespec.config import MoESpecConfig, RuntimeConfig
from trtllm_moespec.engine.config import TreeConfig
from trtllm_moespec.policy_defaults import FORMAT, PolicyDefaults, load_for, with_tuned_options
from trtllm_moespec.resolve import resolve_config

BASE_TUNING = shipped_model_paths("moespec-base")["policy_defaults"]


def _resolved_options(policy: str, model: str = "moespec-base", **spec) -> dict:
    return resolve_config(MoESpecConfig(policy=policy, **spec), RuntimeConfig(model=model)).policy_options


def test_moespec_base_ships_an_ecospec_budget_tuned_on_prompts_the_benchmarks_do_not_use():
    tuned = PolicyDefaults.load(BASE_TUNING).policies["ecospec"]
    assert "--skip-prompts 8" in tuned.record["records"][0]  # the bench and the held-out replay use the first 8
    grid = {p["value"]: p["mean_speedup"] for p in tuned.record["grid"]}
    assert tuned.options["budget"] == max(grid, key=grid.get)
    assert tuned.options["budget"] != 3  # the paper's gamma = 4 is not this model's best, or the file would be moot


def test_the_tuned_option_applies_only_where_the_user_set_none_and_on_its_tree():
    budget = PolicyDefaults.load(BASE_TUNING).policies["ecospec"].options["budget"]
    assert _resolved_options("ecospec") == {"budget": budget}
    assert _resolved_options("ecospec", policy_options={"budget": 3}) == {"budget": 3}  # the user's wins
    assert _resolved_options("ecospec", policy_options={"eps": 0.1}) == {"budget": budget, "eps": 0.1}
    assert _resolved_options("ecospec", tree=TreeConfig(4, 8, 32)) == {}  # tuned for another tree
    assert _resolved_options("evict") == {}  # nothing tuned for it
    assert _resolved_options("ecospec", model="moespec-tiny") == {}  # ships no tuning


def test_tuned_options_for_another_device_do_not_apply(tmp_path):
    path = tmp_path / "policy_defaults.json"
    entry = {"options": {"budget": 5}, "tree": [6, 8, 32], "device": "cuda:NVIDIA H200"}
    path.write_text(json.dumps({"format": FORMAT, "model_id": "m", "policies": {"ecospec": entry}}))
    assert with_tuned_options("ecospec", {}, path, "m", (6, 8, 32), "cpu") == {}
    assert with_tuned_options("ecospec", {}, path, "m", (6, 8, 32), "cuda:NVIDIA H200") == {"budget": 5}
    with pytest.raises(ValueError, match="tuned for model 'm', not 'other'"):
        with_tuned_options("ecospec", {}, path, "other", (6, 8, 32), "cpu")


GOOD = {"options": {"budget": 5}, "tree": [6, 8, 32], "device": "cpu"}


@pytest.mark.parametrize("text, message", [
    ("{not json", "cannot be read as JSON"),
    (json.dumps({"format": "other", "policies": {}}), "not a moespec-policy-defaults/1 file"),
    (json.dumps({"format": FORMAT, "model_id": "m"}), "needs 'model_id' .* and 'policies'"),
    (json.dumps({"format": FORMAT, "model_id": "m", "policies": {"fastest": GOOD}}), "policy 'fastest': unknown policy"),
    (json.dumps({"format": FORMAT, "model_id": "m", "policies": {"ecospec": dict(GOOD, options={"gamma": 5})}}),
     r"policy 'ecospec': unknown options \['gamma'\]"),
    (json.dumps({"format": FORMAT, "model_id": "m", "policies": {"ecospec": dict(GOOD, tree=[6, 8])}}),
     r"'tree' must be \[steps, topk, max_draft_tokens\]"),
    (json.dumps({"format": FORMAT, "model_id": "m", "policies": {"ecospec": dict(GOOD, device=None)}}),
     "'device' must be a string"),
    (json.dumps({"format": FORMAT, "model_id": "m", "policies": {}, "values": {"kind": "best", "tree": [6, 8, 32],
                                                                          "device": "cpu"}}),
     "'values': needs 'kind', one of raw, calibrated, head"),
    (json.dumps({"format": FORMAT, "model_id": "m", "policies": {}, "values": {"kind": "head", "device": "cpu"}}),
     r"'values': 'tree' must be"),
])
def test_a_broken_file_is_named_with_its_problem(tmp_path, text, message):
    path = tmp_path / "policy_defaults.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"policy defaults {path}.*{message}"):
        PolicyDefaults.load(path)


def test_a_saved_file_loads_back(tmp_path):
    path = tmp_path / "policy_defaults.json"
    kept = PolicyDefaults.load(BASE_TUNING)
    kept.save(path)
    assert PolicyDefaults.load(path) == kept


def _resolved_values(model: str = "moespec-base", **spec) -> str:
    return resolve_config(MoESpecConfig(policy="joint", **spec), RuntimeConfig(model=model)).spec.values


def test_moespec_base_chose_the_acceptance_head_from_a_side_by_side_run():
    chosen = PolicyDefaults.load(BASE_TUNING).values
    assert chosen.kind == "head" and chosen.tree == (6, 8, 32) and chosen.device == "cpu"
    assert "--values-sweep head" in chosen.record["made_by"]
    speed = chosen.record["speedup_vs_ar"]
    assert speed["joint[values=head]"] > speed["joint"] and speed["evict[values=head]"] > speed["evict"]


def test_the_chosen_values_apply_only_where_the_user_set_none_and_where_they_were_chosen():
    assert _resolved_values() == "head"
    assert _resolved_values(values="calibrated") == "calibrated"  # the user's wins
    assert _resolved_values(tree=TreeConfig(4, 8, 32), override_profile=True) == "calibrated"  # chosen for another tree
    assert _resolved_values(drafter="ngram") == "calibrated"  # the head reads the EAGLE-3 drafter
    own = shipped_model_paths("moespec-base")["draft"]
    assert _resolved_values(draft_model=own) == "calibrated"  # a drafter given: the head was trained on another's
    assert _resolved_values(model="moespec-tiny") == "calibrated"  # chose none


def test_chosen_values_for_another_device_do_not_apply(tmp_path):
    path = tmp_path / "policy_defaults.json"
    entry = {"kind": "raw", "tree": [6, 8, 32], "device": "cuda:NVIDIA H200"}
    path.write_text(json.dumps({"format": FORMAT, "model_id": "m", "policies": {}, "values": entry}))
    assert load_for(path, "m").values_for((6, 8, 32), "cpu") is None
    assert load_for(path, "m").values_for((6, 8, 32), "cuda:NVIDIA H200") == "raw"
    assert load_for(None, "m") is None  # no file: nothing chosen


def test_moespec_base_ships_a_sampled_guard_prior_from_an_unguarded_run():
    g = PolicyDefaults.load(BASE_TUNING).guard
    assert g.tree == (6, 8, 32) and g.device == "cpu" and g.sampled.temperature == 1.0
    assert g.sampled.tokens_per_step / g.sampled.step_ratio < 1.0  # sampled speculation loses on this model
    assert "guard=off" in g.record["measured_as"] and g.record["evidence"].endswith("bench.json")


def test_the_guard_prior_applies_only_with_the_models_drafter_on_its_tree_and_device(tmp_path):
    def prior(model="moespec-base", **spec):
        return resolve_config(MoESpecConfig(policy="joint", **spec), RuntimeConfig(model=model)).guard_prior

    assert prior() == PolicyDefaults.load(BASE_TUNING).guard.sampled
    assert prior(tree=TreeConfig(4, 8, 32), override_profile=True) is None
    assert prior(draft_model=shipped_model_paths("moespec-base")["draft"]) is None
    assert prior(drafter="ngram") is None
    assert prior(model="moespec-tiny") is None
    path = tmp_path / "policy_defaults.json"
    entry = {"sampled": {"tokens_per_step": 1.2, "step_ratio": 2.0}, "tree": [6, 8, 32], "device": "cuda:NVIDIA H200"}
    path.write_text(json.dumps({"format": FORMAT, "model_id": "m", "policies": {}, "guard": entry}))
    assert load_for(path, "m").guard_prior_for((6, 8, 32), "cpu") is None
    assert load_for(path, "m").guard_prior_for((6, 8, 32), "cuda:NVIDIA H200").tokens_per_step == 1.2
    entry["sampled"]["step_ratio"] = -1
    path.write_text(json.dumps({"format": FORMAT, "model_id": "m", "policies": {}, "guard": entry}))
    with pytest.raises(ValueError, match="'guard': 'sampled': SampledPrior.step_ratio must be"):
        PolicyDefaults.load(path)
