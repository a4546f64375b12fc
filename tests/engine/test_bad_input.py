"""Bad input fails early with a clear error (API: exception; CLI: one line, exit code 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import transformers

from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.models.eagle3 import write_random_drafter
from tests.models.conftest import qwen3_moe_config


def test_missing_and_unsupported_checkpoints(tmp_path, checkpoints):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope"), policy="ar")
    dense = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    transformers.Qwen3ForCausalLM(dense).save_pretrained(str(tmp_path / "dense"))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(str(tmp_path / "dense"), policy="ar")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((checkpoints["qwen3_moe"][0] / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(ValueError):
        LLM(str(corrupt), policy="ar")


def test_drafter_that_does_not_match_the_target(tmp_path, checkpoints):
    target, _ = checkpoints["qwen3_moe"]
    other = write_random_drafter(qwen3_moe_config(hidden_size=96, head_dim=24), tmp_path / "wrong", seed=0)
    with pytest.raises(ValueError, match="96"):
        LLM(str(target), draft_model=str(other), policy="eagle3")


def test_policy_prerequisites_are_checked_before_loading(tmp_path, checkpoints):
    target, draft = checkpoints["qwen3_moe"]
    with pytest.raises(ValueError, match="draft model"):
        LLM(str(target), policy="eagle3")
    with pytest.raises(ValueError, match="predictor"):
        LLM(str(target), draft_model=str(draft), policy="ecospec")
    with pytest.raises(ValueError, match="unknown policy"):
        LLM(str(target), policy="fastest")
    with pytest.raises(ValueError, match="moespec profile"):
        LLM(str(target), draft_model=str(draft), policy="evict", cost_profile=str(tmp_path / "none.json"))
    profile = json.loads((target / "cost_profile.json").read_text())
    profile["device"] = "cuda:NVIDIA H200"
    (tmp_path / "h200.json").write_text(json.dumps(profile))
    with pytest.raises(ValueError, match="device"):
        LLM(str(target), draft_model=str(draft), policy="evict", cost_profile=str(tmp_path / "h200.json"))
    LLM(str(target), draft_model=str(draft), policy="evict", cost_profile=str(tmp_path / "h200.json"),
        override_profile=True)


def test_prompts_and_sampling_parameters(checkpoints):
    target, _ = checkpoints["qwen3_moe"]
    llm = LLM(str(target), policy="ar")
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="context"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=10_000))
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        llm.generate([[1, 500]])
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text prompt"])
    for bad in ({"max_tokens": 0}, {"temperature": -0.5}, {"top_p": 0.0}, {"top_k": -2}, {"seed": "x"},
                {"stop": [""]}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_cli_reports_one_line_and_exit_code_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "trtllm_moespec.cli", "generate", "--model", str(tmp_path / "none"),
                          "--policy", "ar"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "not found" in out.stderr
