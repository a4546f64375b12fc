"""C(k) profiling of an engine directory (issue 26 F1, F4): the profile `profile_engine` writes is the one
the worker loads, and the forced acceptance is made to reach TensorRT-LLM's worker and then checked.

TensorRT-LLM's generate is replaced by a measurement function (the only TensorRT-LLM call); everything
`profile_engine` owns (process set-up, acceptance check, interpolation, expert fit, the file) runs for real.
"""

import json

import pytest

from tests.backends.test_build import eagle3_config, hf_config
from trtllm_moespec.backends.trtllm import build
from trtllm_moespec.backends.trtllm.config import load_engine_spec
from trtllm_moespec.backends.trtllm.presets import PRESETS
from trtllm_moespec.backends.trtllm.profile import (FORCE_ACCEPT_ENV, SINGLE_PROCESS_ENV, Timing,
                                                     check_forced_acceptance, expected_unique_experts,
                                                     fit_expert_costs, prepare_profiling_process, profile_engine)
from trtllm_moespec.backends.trtllm.reach import worker_policy, worker_settings
from trtllm_moespec.backends.trtllm.selection import OpSelector, make_selector
from trtllm_moespec.core.cost import CostTable

PRESET = PRESETS["qwen3-30b-a3b"]


def _engine(tmp_path, tp=1, lengths="4,8,16,32", policy="joint"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    ckpt, draft, predictor = tmp_path / "ckpt", tmp_path / "draft", tmp_path / "predictor"
    for d, cfg in ((ckpt, hf_config(PRESET)), (draft, eagle3_config(PRESET))):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
    predictor.mkdir()
    out = tmp_path / "engine"
    rc = build.main(["--model", "qwen3-30b-a3b", "--checkpoint", str(ckpt), "--draft-model", str(draft),
                     "--policy", policy, "--predictor", str(predictor), "--tp", str(tp), "--ep", str(tp),
                     "--verify-lengths", lengths, "--out", str(out), "--dry-run"])
    assert rc == 0
    return out


def fake_trtllm(seconds_per_iteration, accept=True):
    """A measurement as `_trtllm_measure` returns it: with forced acceptance, D drafts per generation step."""

    def measure(options, checkpoint, num_tokens, repeats):
        spec = options.get("speculative_config")
        k = spec["max_total_draft_tokens"] if spec else 0
        depth = spec["max_draft_len"] if spec else 0
        steps = 1 + -(-(num_tokens - 1) // (depth + 1)) if accept else num_tokens
        accepted = num_tokens - steps
        return Timing(seconds_per_iteration(k) * steps, num_tokens, accepted)

    return measure


def test_the_profile_profile_engine_writes_lets_the_worker_run_joint(tmp_path):
    engine = _engine(tmp_path)
    spec = load_engine_spec(engine)
    cost = lambda k: 0.020 + 0.0001 * k + 2e-6 * expected_unique_experts(PRESET, k + 1)  # noqa: E731
    environ = {}
    spec = profile_engine(spec, engine, num_tokens=128, repeats=1, measure=fake_trtllm(cost), version="1.3.0rc9",
                          device="test GPU", environ=environ)
    build.write_engine_dir(spec, engine, "moespec build ...")
    spec = load_engine_spec(engine)
    table = CostTable.load(engine / spec.cost_profile)
    assert table.expert_model is not None and table.expert_model.c_exp > 0
    assert table.costs[0] == pytest.approx(cost(0), rel=1e-6) and table.costs[32] == pytest.approx(cost(32), rel=1e-6)
    assert environ == {SINGLE_PROCESS_ENV: "1", FORCE_ACCEPT_ENV: "4"}  # set before any LLM is built
    assert worker_policy(spec, engine) == "joint"
    selector = make_selector(worker_settings(spec, engine), 32)  # what the worker's constructor does
    assert isinstance(selector, OpSelector) and selector.mode == "joint"


def test_worker_policy_loads_what_the_worker_will_load(tmp_path, caplog):
    engine = _engine(tmp_path)
    spec = load_engine_spec(engine)
    assert worker_policy(spec, engine) == "eagle3"  # dry run: no cost profile
    (engine / "cost_profile.json").write_text(json.dumps(CostTable(costs=(0.01, 0.02)).to_json()))
    import dataclasses

    profiled = dataclasses.replace(spec, cost_profile="cost_profile.json")
    assert worker_policy(profiled, engine) == "evict"  # a table without the expert fit cannot run joint
    assert "no expert_model fit" in caplog.text


def test_forced_acceptance_is_checked_on_the_request_metrics(tmp_path):
    engine = _engine(tmp_path, lengths="8")
    spec = load_engine_spec(engine)
    with pytest.raises(RuntimeError, match="did not reach TensorRT-LLM's worker"):
        profile_engine(spec, engine, num_tokens=64, repeats=1, measure=fake_trtllm(lambda k: 0.01, accept=False),
                       version="1.3.0rc9", device="test GPU", environ={})
    check_forced_acceptance(Timing(1.0, 21, 16), 4)  # 5 steps: context + 4 x (4 drafts + 1)
    with pytest.raises(RuntimeError):
        check_forced_acceptance(Timing(1.0, 21, 8), 4)


def test_multi_gpu_profiles_need_the_knob_on_every_rank(tmp_path):
    spec = load_engine_spec(_engine(tmp_path, tp=2))
    with pytest.raises(ValueError, match=f"mpirun -n 2 -x {FORCE_ACCEPT_ENV}=4"):
        prepare_profiling_process(spec, world_size=1, environ={})
    with pytest.raises(ValueError, match="mpirun"):
        prepare_profiling_process(spec, world_size=2, environ={})
    assert prepare_profiling_process(spec, world_size=2, environ={FORCE_ACCEPT_ENV: "4"}) == "mpi-ranks"
    one = load_engine_spec(_engine(tmp_path / "one"))
    with pytest.raises(ValueError, match=SINGLE_PROCESS_ENV):
        prepare_profiling_process(one, world_size=1, environ={SINGLE_PROCESS_ENV: "0"})


def test_expert_fit_from_two_or_more_lengths():
    cost = lambda k: 0.02 + 3e-6 * expected_unique_experts(PRESET, k + 1)  # noqa: E731
    two = fit_expert_costs({0: cost(0), 32: cost(32)}, PRESET)
    assert two.c_tok == 0 and two.c_exp == pytest.approx(3e-6) and two.c0 == pytest.approx(0.02)
    many = fit_expert_costs({k: cost(k) for k in (0, 4, 8, 16, 32)}, PRESET)
    assert many.predict(16, expected_unique_experts(PRESET, 17)) == pytest.approx(cost(16), rel=1e-6)
    with pytest.raises(ValueError, match="at least two"):
        fit_expert_costs({0: 0.01}, PRESET)
