"""Executor backend choice, fallback arguments and TensorRT-LLM statistics (CPU)."""

import dataclasses
import importlib.util
import logging
import math
from pathlib import Path

import pytest

from trtllm_moespec.backends.trtllm.config import load_engine_spec
from trtllm_moespec.backends.trtllm.version import trtllm_available
from trtllm_moespec.runtime import Executor
from trtllm_moespec.backends.trtllm.reach import worker_policy as trtllm_worker_policy
from trtllm_moespec.runtime.executor import acceptance_stats, choose_backend, pytorch_llm_kwargs

TINY = Path(__file__).resolve().parents[2] / "trtllm_moespec" / "assets" / "moespec-tiny"


def test_choose_backend():
    assert choose_backend("auto", True) == "tensorrt_llm"
    assert choose_backend("auto", False) == "pytorch"
    assert choose_backend("pytorch", True) == "pytorch"
    with pytest.raises(RuntimeError, match="not importable"):
        choose_backend("tensorrt_llm", False)
    with pytest.raises(ValueError, match="unknown backend"):
        choose_backend("vllm", False)


def test_pytorch_fallback_arguments_mirror_the_engine_dir(engine_dir):
    spec = load_engine_spec(engine_dir)
    kwargs = pytorch_llm_kwargs(spec, engine_dir, None, None)
    assert kwargs["model"] == spec.checkpoint and kwargs["draft_model"] == spec.draft_model
    assert kwargs["policy"] == "eagle3" and kwargs["tree"] == {"steps": 4, "topk": 8, "max_draft_tokens": 32}
    assert kwargs["cost_profile"] is None and kwargs["device"] == "cpu" and kwargs["dtype"] == "bfloat16"


def test_worker_policy_degrades_expert_aware_policies(engine_dir, caplog):
    spec = load_engine_spec(engine_dir)
    assert trtllm_worker_policy(spec, engine_dir) == "eagle3"
    joint = dataclasses.replace(spec, policy="joint")
    with caplog.at_level(logging.WARNING):
        assert trtllm_worker_policy(joint, engine_dir) == "eagle3"  # no cost profile in a dry run
    assert "cannot run inside the TensorRT-LLM worker" in caplog.text
    # A cost profile that is named but not there does not count (the worker would fail to load it).
    profiled = dataclasses.replace(spec, policy="joint", cost_profile="cost_profile.json")
    assert trtllm_worker_policy(profiled, engine_dir) == "eagle3"


def test_acceptance_stats_from_trtllm_counters():
    s = acceptance_stats(num_tokens=30, accepted_draft_tokens=20, draft_tokens=80)  # 10 iterations
    assert (s.num_steps, s.mean_accepted_tokens, s.verified_tokens) == (10, 3.0, 8.0)
    assert math.isnan(acceptance_stats(0, 0, 0).mean_accepted_tokens)


@pytest.mark.skipif(trtllm_available(), reason="tensorrt_llm installed: the executor would choose it")
def test_executor_says_which_backend_runs(engine_dir, caplog, monkeypatch):
    monkeypatch.setattr("trtllm_moespec.runtime.executor.pytorch_llm_kwargs",
                        lambda *a: (_ for _ in ()).throw(ValueError("stop after the backend choice")))
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="stop after"):
        Executor(engine_dir)
    assert "tensorrt_llm is not available; running" in caplog.text and "PyTorch engine" in caplog.text


def _engine_ready() -> str | None:
    if importlib.util.find_spec("trtllm_moespec.api") is None:
        return "trtllm_moespec.LLM (trtllm_moespec/api.py) does not exist yet"
    if not (TINY / "target" / "config.json").is_file() or not (TINY / "eagle3" / "config.json").is_file():
        return f"the moespec-tiny checkpoints are not in {TINY} yet"
    return None


@pytest.mark.skipif(_engine_ready() is not None, reason=str(_engine_ready()))
def test_executor_fallback_end_to_end_on_moespec_tiny(tmp_path):
    from trtllm_moespec import LLM, SamplingParams, TreeConfig
    from trtllm_moespec.backends.trtllm import build

    out = tmp_path / "engine"
    rc = build.main(["--model", str(TINY / "target"), "--draft-model", str(TINY / "eagle3"), "--policy", "eagle3",
                     "--verify-lengths", "8", "--max-draft-tokens", "8", "--out", str(out), "--dry-run"])
    assert rc == 0
    executor = Executor(out, "pytorch", device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=16, temperature=0.0)
    got = executor.generate(["def add(a, b):"], params)[0]
    ref = LLM(model=str(TINY / "target"), draft_model=str(TINY / "eagle3"), policy="ar",
              tree=TreeConfig(steps=4, topk=8, max_draft_tokens=8), device="cpu", dtype="float32")
    want = ref.generate(["def add(a, b):"], params)[0]
    assert list(got.token_ids) == list(want.token_ids)  # greedy speculative == plain decoding
    assert got.stats.mean_accepted_tokens > 1  # eagle3 on its trained drafter: drafts were accepted


@pytest.mark.skipif(_engine_ready() is not None, reason=str(_engine_ready()))
def test_two_concurrent_requests_share_batched_steps(tmp_path):
    """The PyTorch backend is the batched engine: two callers on two threads share engine steps,
    and each gets exactly what it gets alone (T=0)."""
    import threading

    from trtllm_moespec import SamplingParams
    from trtllm_moespec.backends.trtllm import build

    out = tmp_path / "engine"
    assert build.main(["--model", str(TINY / "target"), "--draft-model", str(TINY / "eagle3"), "--policy", "eagle3",
                       "--verify-lengths", "8", "--max-draft-tokens", "8", "--out", str(out), "--dry-run"]) == 0
    executor = Executor(out, "pytorch", device="cpu", dtype="float32", max_batch_size=2)
    assert executor.batched
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["def add(a, b):", "The capital of France is"]
    alone = [executor.generate([p], params)[0].token_ids for p in prompts]
    metrics = executor._impl.scheduler.metrics
    steps_before, size_before = metrics.engine_steps, metrics.batch_size_sum
    start, got = threading.Barrier(2), [None, None]

    def call(i: int) -> None:
        start.wait()
        got[i] = executor.generate([prompts[i]], params)[0].token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    executor.shutdown()
    assert got == alone
    steps, requests = metrics.engine_steps - steps_before, metrics.batch_size_sum - size_before
    assert requests > steps  # some steps carried both requests (alone, every step carries one)


def test_executor_rejects_a_bad_batch_size(engine_dir):
    with pytest.raises(ValueError, match="max_batch_size"):
        Executor(engine_dir, "pytorch", max_batch_size=0)


def test_trtllm_sampling_keywords_leave_off_values_to_the_runtime():
    """Penalties, min_p, min_tokens and top-k at their "off" values go as None (TensorRT-LLM's SamplingParams then keeps its C++
    defaults, sampling_params.py @ a98a9061d72f6fd39f5d055ebdd2c6878a100e2c); set ones pass through, and so do stop, include_stop_str_in_output,
    ignore_eos and skip_special_tokens (fields of that class at that commit); what the backend cannot honour is
    refused."""
    from trtllm_moespec import SamplingParams
    from trtllm_moespec.runtime.executor import trtllm_sampling_kwargs

    off = trtllm_sampling_kwargs(SamplingParams(max_tokens=5))
    assert off["top_k"] is None and off["repetition_penalty"] is None
    assert off["presence_penalty"] is None and off["frequency_penalty"] is None and off["max_tokens"] == 5
    on = trtllm_sampling_kwargs(SamplingParams(top_k=4, repetition_penalty=1.2, presence_penalty=-0.5,
                                               frequency_penalty=0.3, stop="x", seed=3))
    assert (on["top_k"], on["repetition_penalty"], on["presence_penalty"], on["frequency_penalty"]) == (4, 1.2, -0.5, 0.3)
    assert on["stop"] == ("x",) and on["seed"] == 3 and on["return_perf_metrics"]
    assert not off["ignore_eos"] and not off["include_stop_str_in_output"] and off["skip_special_tokens"]
    assert off["bad"] is None and trtllm_sampling_kwargs(SamplingParams(bad_words=["x y"]))["bad"] == ["x y"]
    kept = trtllm_sampling_kwargs(SamplingParams(stop="x", include_stop_str_in_output=True, ignore_eos=True,
                                                 skip_special_tokens=False))
    assert kept["include_stop_str_in_output"] and kept["ignore_eos"] and not kept["skip_special_tokens"]
    assert off["min_p"] is None and off["min_tokens"] is None and off["stop_token_ids"] is None
    more = trtllm_sampling_kwargs(SamplingParams(min_p=0.1, min_tokens=2, stop_token_ids=[7]))
    assert (more["min_p"], more["min_tokens"], more["stop_token_ids"]) == (0.1, 2, [7])
    with pytest.raises(ValueError, match="logit_bias is not supported by the TensorRT-LLM backend"):
        trtllm_sampling_kwargs(SamplingParams(logit_bias={3: 1.0}))
    for name, value in (("logprobs", 1), ("prompt_logprobs", 1), ("allowed_token_ids", [3])):
        with pytest.raises(ValueError, match=f"{name} is not supported by the TensorRT-LLM backend"):
            trtllm_sampling_kwargs(SamplingParams(**{name: value}))
    from trtllm_moespec import StructuredOutput
    with pytest.raises(ValueError, match="structured is not supported by the TensorRT-LLM backend"):
        trtllm_sampling_kwargs(SamplingParams(structured=StructuredOutput.of(json_object=True)))
