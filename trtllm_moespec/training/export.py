"""Export of trained checkpoints into the shipped Hugging Face style directories.

target/: ``config.json`` (Qwen3MoeConfig), ``model.safetensors`` in fp16,
``generation_config.json`` and the tokenizer files; loads with plain
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.
predictor/: ``config.json`` + ``model.safetensors`` (fp16) of ``ExpertPredictor``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeForCausalLM

from trtllm_moespec.models.predictor import ExpertPredictor, PredictorConfig, PredictorModel
from trtllm_moespec.training.target import TargetShape, make_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def load_target_checkpoint(run_dir: Path) -> Qwen3MoeForCausalLM:
    """The fp32 target of ``run_dir/ckpt`` with the shape of ``run_dir/run_config.json``."""
    config_path, weights = run_dir / "run_config.json", run_dir / "ckpt" / "model.safetensors"
    for path in (config_path, weights):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: train the target first")
    shape = TargetShape(**json.loads(config_path.read_text())["shape"])
    model = Qwen3MoeForCausalLM(make_config(shape))
    missing, unexpected = model.load_state_dict(load_file(str(weights)), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise ValueError(f"{weights} does not match {config_path}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def export_target(run_dir: Path, tokenizer_dir: Path, out_dir: Path) -> Path:
    """Write the fp16 target and its tokenizer to ``out_dir`` and check they load."""
    model = load_target_checkpoint(run_dir).to(torch.float16)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)
    _make_readable(out_dir)
    AutoModelForCausalLM.from_pretrained(out_dir)
    AutoTokenizer.from_pretrained(out_dir)
    return out_dir


def _make_readable(directory: Path) -> None:
    """safetensors writes 0600 files; packaged assets must be world-readable."""
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o644)


def export_predictor(run_dir: Path, out_dir: Path) -> Path:
    """Write the trained predictor (fp16) to ``out_dir`` and check it loads."""
    config_path = run_dir / "predictor_config.json"
    cfg = PredictorConfig.from_json(config_path.read_text(), str(config_path))
    model = PredictorModel(cfg)
    model.load_state_dict(load_file(str(run_dir / "ckpt" / "model.safetensors")))
    shutil.rmtree(out_dir, ignore_errors=True)
    ExpertPredictor(model).save(out_dir, dtype=torch.float16)
    _make_readable(out_dir)
    ExpertPredictor.load(out_dir)
    return out_dir
