"""Benchmark prompts: bundled datasets and their tokenization (chat template, plain, no tokenizer)."""

from __future__ import annotations

import pytest

from trtllm_moespec.bench.datasets import DATA_DIR, encode_prompt, load_prompts, tokenization_note


def test_datasets_load_in_file_order_with_licenses():
    he = load_prompts("humaneval", 2)
    assert [p.prompt_id for p in he] == ["HumanEval/0", "HumanEval/1"] and "def " in he[0].text
    mt = load_prompts("mt_bench", 3)
    assert mt[0].prompt_id == "81" and mt[0].text.startswith("Compose an engaging travel blog post")
    gsm = load_prompts("gsm8k", 1)
    assert gsm[0].text.startswith("Janet") and "####" not in gsm[0].text  # question only, no answer
    assert len(load_prompts("mt_bench", 1000)) == 80 and len(load_prompts("gsm8k", 5000)) == 1319
    for name in ("mt_bench", "gsm8k"):
        assert (DATA_DIR / name / "LICENSE").is_file()
    with pytest.raises(ValueError, match="unknown dataset"):
        load_prompts("squad", 1)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from trtllm_moespec.training.tokenizer import save_pretrained, train_bpe

    path = tmp_path_factory.mktemp("tok")
    save_pretrained(train_bpe(["def add(a, b):\n    return a + b\n"] * 20, vocab_size=300), path)
    return AutoTokenizer.from_pretrained(str(path))


def test_plain_tokenizer_and_chat_template(tokenizer):
    text = "def add(a, b):"
    assert encode_prompt(text, tokenizer, 300, 100) == tokenizer.encode(text, add_special_tokens=False)
    assert tokenization_note(tokenizer).startswith("plain")
    tokenizer.chat_template = "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}<bot>"
    try:
        ids = encode_prompt(text, tokenizer, 300, 100)
        assert tokenizer.decode(ids) == f"<user>{text}</user><bot>"
        assert tokenization_note(tokenizer) == "chat template"
    finally:
        tokenizer.chat_template = None


def test_no_tokenizer_bytes_and_left_truncation():
    assert encode_prompt("ab\u00e9", None, 128, 10) == [97, 98, 0xC3 % 128, 0xA9 % 128]
    assert encode_prompt("abcdef", None, 128, 3) == [100, 101, 102]  # keeps the end of the prompt
    with pytest.raises(ValueError, match="no room"):
        encode_prompt("abc", None, 128, 0)
