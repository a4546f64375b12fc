"""Expert parallelism under a real `mpirun -n 2` on CPU (gloo): exactness against one process for
every policy, same-seed sampling, per-rank stats, a killed or failing rank, bad launch arguments.

One mpirun job runs every exactness case (tests/parallel/ep_job.py): starting ranks costs more
than generating a few tokens with a tiny model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import transformers

from tests.engine.conftest import make_checkpoint
from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.assets import tiny_model_paths
from trtllm_moespec.core.placement import ExpertPlacement

MPIRUN = str(Path(sys.executable).with_name("mpirun")) if Path(sys.executable).with_name("mpirun").exists() \
    else shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="no mpirun (pip install mpich)")
REPO = Path(__file__).resolve().parents[2]
POLICIES = ["ar", "eagle3", "ddd", "evict", "ecospec", "joint", "coverage", "oracle"]
MAX_TOKENS = 12
TINY_PROMPT = "def add(a, b):\n    "
GPT_OSS_PROMPT = [5, 17, 33, 2, 9, 100, 4]
SAMPLED = [("moespec-tiny", "joint", 0.8, 3), ("moespec-tiny", "eagle3", 1.0, 5), ("gpt_oss", "ecospec", 0.9, 7)]


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, draft = make_checkpoint(tmp_path_factory.mktemp("ep_models"), "gpt_oss")  # 8 experts, top-2
    return {"moespec-tiny": {"model": "moespec-tiny", "prompts": [TINY_PROMPT]},
            "gpt_oss": {"model": str(target), "draft_model": str(draft), "prompts": [GPT_OSS_PROMPT]}}


def _case(models, arch, policy, temperature=0.0, seed=None, **extra) -> dict:
    m = models[arch]
    predictor = "oracle" if arch == "gpt_oss" and policy in ("ecospec", "joint") else None
    return {"name": f"{arch}/{policy}/{temperature}/{extra}", "arch": arch, "model": m["model"],
            "draft_model": m.get("draft_model"), "policy": policy, "predictor": predictor, "prompts": m["prompts"],
            "max_tokens": MAX_TOKENS, "temperature": temperature, "seed": seed, **extra}


@pytest.fixture(scope="module")
def ep_results(models, tmp_path_factory):
    cases = [_case(models, arch, p) for arch in models for p in POLICIES]
    cases.append(_case(models, "moespec-tiny", "joint", ep_pricing=False))
    cases += [_case(models, arch, "eagle3", model_impl="hf") for arch in models]  # transformers' forward, sharded
    # Sampled cases run without the goodput guard: its speculate-or-not choice follows wall time, which
    # differs between the 2-rank job and one process, and a different tree draws different random numbers.
    cases += [_case(models, arch, p, t, s, guard="off") for arch, p, t, s in SAMPLED]
    tmp = tmp_path_factory.mktemp("ep_job")
    (tmp / "cases.json").write_text(json.dumps(cases))
    result = subprocess.run([MPIRUN, "-n", "2", sys.executable, "-m", "tests.parallel.ep_job", str(tmp / "cases.json"),
                             str(tmp / "results.json")], capture_output=True, text=True, timeout=900, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return cases, {r["name"]: r for r in json.loads((tmp / "results.json").read_text())}


def _hf_greedy(path, prompt_ids, gpt_oss: bool) -> list[int]:
    kwargs = {"attn_implementation": "eager"} if gpt_oss else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs)
    out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_greedy_is_exact_for_every_policy_on_two_ranks(models, ep_results):
    cases, results = ep_results
    tiny = tiny_model_paths()["target"]
    tiny_ids = transformers.AutoTokenizer.from_pretrained(str(tiny)).encode(TINY_PROMPT, add_special_tokens=False)
    refs = {"moespec-tiny": _hf_greedy(tiny, tiny_ids, False),
            "gpt_oss": _hf_greedy(models["gpt_oss"]["model"], GPT_OSS_PROMPT, True)}
    greedy = [c for c in cases if c["temperature"] == 0.0]
    assert {(c["arch"], c["policy"]) for c in greedy} >= {(a, p) for a in models for p in POLICIES}
    for case in greedy:
        assert results[case["name"]]["token_ids"] == [refs[case["arch"]]], case["name"]


def test_same_seed_sampling_matches_one_process(models, ep_results):
    cases, results = ep_results
    for case in (c for c in cases if c["temperature"] > 0):
        # Same tree selection as the 2-rank job (EP-aware pricing needs the same placement), else the
        # verifier draws its random numbers over a different tree.
        options = {}
        if case["policy"] in ("ecospec", "joint"):
            experts = 32 if case["arch"] == "moespec-tiny" else 8
            options["placement"] = ExpertPlacement.contiguous(4, experts, 2)  # both models: 4 MoE layers
        llm = LLM(case["model"], draft_model=case["draft_model"], policy=case["policy"], predictor=case["predictor"],
                  policy_options=options, model_impl=case.get("model_impl", "lean"), guard=case.get("guard", "auto"))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=case["temperature"], seed=case["seed"],
                                ignore_eos=True)
        outs = llm.generate(case["prompts"], params)
        assert results[case["name"]]["token_ids"] == [o.token_ids for o in outs], case["name"]
        if case["arch"] == "moespec-tiny":  # a trained drafter: the sampled verification accepted drafts, on both sides
            assert sum(s.accepted_tokens for o in outs for s in o.steps) > 0, case["name"]
            assert results[case["name"]]["stats"][0]["mean_accepted_tokens"] > 1.0, case["name"]


def test_stats_report_experts_per_rank_and_ep_pricing_is_used(ep_results):
    cases, results = ep_results
    for case in cases:
        r = results[case["name"]]
        stats = r["stats"][0]
        assert r["placement_ranks"] == 2
        # every MoE layer runs sharded on rank 0: half of the experts, all-reduced slot outputs
        experts = 32 if case["arch"] == "moespec-tiny" else 8
        assert r["local_experts"] == [experts // 2] * 4 and r["sharded_calls"] >= 4
        assert len(stats["unique_experts_per_rank"]) == 2
        per_rank = stats["unique_experts_per_rank"]
        if stats["num_steps"]:
            # each layer's busiest rank computes at least half of that layer's union, at most all of it
            assert max(per_rank) - 1e-9 <= stats["busiest_rank_experts_per_layer"] <= stats["unique_experts_per_layer"] + 1e-9
            assert stats["busiest_rank_experts_per_layer"] >= stats["unique_experts_per_layer"] / 2 - 1e-9
        priced = case["policy"] in ("ecospec", "joint") and case.get("ep_pricing", True)
        assert r["policy_placement"] == priced, case["name"]


def _generate_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "trtllm_moespec.cli", "generate", "--max-tokens", "48", "--json", *args]


def _leftover(marker: str) -> list[int]:
    """Processes still carrying this test's environment marker (orphans)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("kind", ["kill", "raise"])
def test_a_failing_rank_ends_every_rank_quickly_with_one_line(kind):
    marker = f"MOESPEC_TEST_{uuid.uuid4().hex}"
    env = _env(MOESPEC_EP_FAULT=f"1:6:{kind}", **{marker: "1"})  # rank 1 fails at its 6th command (mid-decode)
    result = subprocess.run([MPIRUN, "-n", "2", *_generate_cmd("--ep", "2", "--policy", "eagle3")],
                            capture_output=True, text=True, timeout=300, env=env)
    ended = time.time()
    assert result.returncode != 0
    lines = [ln for ln in (result.stdout + result.stderr).splitlines() if ln.startswith("moespec: error: rank")]
    assert lines, result.stderr[-2000:]
    if kind == "raise":
        assert any(ln.startswith("moespec: error: rank 1: RuntimeError: injected fault") for ln in lines), lines
    else:  # whoever sees it first names rank 1: its supervisor (the signal) or a peer (its process is gone)
        assert any(ln.startswith("moespec: error: rank 1: killed by SIGKILL")
                   or ln.startswith("moespec: error: rank 0: rank 1 ended unexpectedly") for ln in lines), lines
    assert "Traceback" not in result.stderr
    # from the fault (rank 1 prints its wall-clock time first) to the end of the whole job
    fault_at = float(re.search(r"injecting a fault \((?:kill|raise)\) at t=([0-9.]+)", result.stderr).group(1))
    assert ended - fault_at < 30, ended - fault_at
    time.sleep(0.5)
    assert _leftover(marker) == []


@pytest.mark.parametrize("ranks,args,message", [
    (1, ["--ep", "2"], "--ep 2 needs 2 ranks: launch with `mpirun -n 2"),
    (2, ["--ep", "4"], "mpirun started 2 ranks but --ep is 4"),
    (3, ["--ep", "3"], "--ep 3 does not divide the model's 32 experts per layer"),
])
def test_bad_launch_arguments_are_one_line_and_exit_2(ranks, args, message):
    cmd = _generate_cmd(*args) if ranks == 1 else [MPIRUN, "-n", str(ranks), *_generate_cmd(*args)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert errors == [f"moespec: error: {errors[0].removeprefix('moespec: error: ')}"] and message in errors[0], errors
