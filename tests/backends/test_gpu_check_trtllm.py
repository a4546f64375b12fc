"""benchmarks/gpu_check_trtllm.py skips cleanly where it cannot run (no CUDA, no tensorrt_llm), as on CPU CI
and on a GPU machine without TensorRT-LLM: skipped sections are recorded, and the exit status is 0."""

import importlib.util
import json

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available() or importlib.util.find_spec("tensorrt_llm") is not None,
                    reason="this machine can run the sections")
def test_sections_skip_cleanly_without_cuda_and_tensorrt_llm(tmp_path, capsys):
    from benchmarks.gpu_check_trtllm import main

    assert main(["--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_check_trtllm.json").read_text())
    assert set(result) == {"graph_capture", "trtllm_install", "trtllm_tiny"}
    assert result["graph_capture"]["skipped"] == "no CUDA device"
    assert result["trtllm_install"]["skipped"] == result["trtllm_tiny"]["skipped"] == "tensorrt_llm is not installed"
    assert "trtllm graph_capture" in capsys.readouterr().out
