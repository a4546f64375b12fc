"""Tiny random Qwen3-MoE and GPT-OSS checkpoints with random EAGLE-3 drafters and cost profiles."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from tests.models.conftest import build_hf, gpt_oss_config, qwen3_moe_config
from trtllm_moespec import TreeConfig
from trtllm_moespec.core import CostTable, ExpertCostModel
from trtllm_moespec.models.acceptance_head import write_random_acceptance_head
from trtllm_moespec.models.eagle3 import write_random_drafter


def make_checkpoint(root, name: str):
    """Write target, drafter, acceptance head and a cost profile for tree (4, 8, 32); returns (target_dir, draft_dir)."""
    config = qwen3_moe_config() if name == "qwen3_moe" else gpt_oss_config()
    model = build_hf(config)
    target = root / name
    model.save_pretrained(str(target))
    draft = write_random_drafter(model.config, root / f"{name}_eagle3", seed=0)
    c = model.config  # an (untrained) acceptance head beside the target: values="head" finds it there
    write_random_acceptance_head(target / "acceptance_head", c.hidden_size, c.hidden_size, c.vocab_size, seed=0)
    CostTable(tuple(0.010 + 0.0004 * k for k in range(33)), model_id=name, device="cpu", dtype="float32",
              tree=(4, 8, 32), method="synthetic (tests)",
              expert_model=ExpertCostModel(0.010, 0.0002, 0.0001)).save(target / "cost_profile.json")
    return target, draft


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_models")
    return {name: make_checkpoint(root, name) for name in ("qwen3_moe", "gpt_oss")}


TINY_TARGET = Path(__file__).resolve().parents[2] / "trtllm_moespec" / "assets" / "moespec-tiny" / "target"


def make_tokenized_checkpoint(root) -> Path:
    """A random Qwen3-MoE with moespec-tiny's tokenizer (vocab 4096) and a 512-token context: text prompts,
    fast loading. No drafter (use policy 'ar' or drafter 'ngram')."""
    path = Path(root) / "tokenized"
    build_hf(qwen3_moe_config(vocab_size=4096, max_position_embeddings=512)).save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY_TARGET / name, path / name)
    return path


def forced_speculation(model_id: str = "moespec-tiny", tree: TreeConfig = TreeConfig()) -> dict:
    """LLM keyword arguments under which a cost-aware policy speculates wherever it can: no goodput
    guard, no drafting stop rule, and a profile where a verified node costs a millionth of the step
    (C(k) and the expert fit nearly flat), so evict's and joint's utility peaks at the largest tree.
    Left to their measured costs they decline on a CPU, and a test of acceptance would accept nothing."""
    costs = CostTable(tuple(1.0 + 1e-6 * k for k in range(tree.max_draft_tokens + 1)), model_id=model_id,
                      device="cpu", dtype="float32", tree=tree.as_tuple(), method="forced cheap (tests)",
                      expert_model=ExpertCostModel(1.0, 1e-6, 1e-6))
    return {"guard": "off", "draft_stop": False, "cost_profile": costs, "tree": tree}


def expert_term_off(model_id: str) -> dict:
    """forced_speculation with a profile that measured joint's expert term as not paying: U moves a step
    by 1 us at fixed k, the predictor and greedy cost 1 ms (core/cost.py expert_term_pays)."""
    forced = forced_speculation(model_id=model_id)
    profile = forced["cost_profile"]
    model = replace(profile.expert_model, c_exp_within=1e-7, unique_spread=10.0)
    return {**forced, "cost_profile": replace(profile, expert_model=model, expert_overhead=1e-3)}


def hf_greedy_references(target_dir, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """transformers' own greedy continuation (no eos stop) of each text prompt: the exactness reference."""
    tok = transformers.AutoTokenizer.from_pretrained(str(target_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    refs = []
    for prompt in prompts:
        ids = tok.encode(prompt, add_special_tokens=False)
        out = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        refs.append(out[0, len(ids):].tolist())
    return refs
