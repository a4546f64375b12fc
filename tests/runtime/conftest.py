"""Fixtures: dry-run engine directories built with the real `moespec build` code."""

import json

import pytest

from tests.backends.test_build import eagle3_config, hf_config
from trtllm_moespec.backends.trtllm import build
from trtllm_moespec.backends.trtllm.presets import PRESETS


@pytest.fixture
def engine_dir(tmp_path):
    """A dry-run engine for qwen3-30b-a3b with stand-in checkpoint directories (config.json only)."""
    ckpt, draft = tmp_path / "ckpt", tmp_path / "draft"
    for d, cfg in ((ckpt, hf_config(PRESETS["qwen3-30b-a3b"])), (draft, eagle3_config(PRESETS["qwen3-30b-a3b"]))):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "engine"
    rc = build.main(["--model", "qwen3-30b-a3b", "--checkpoint", str(ckpt), "--draft-model", str(draft),
                     "--policy", "eagle3", "--tp", "2", "--ep", "2", "--verify-lengths", "8,16",
                     "--out", str(out), "--dry-run"])
    assert rc == 0
    return out
