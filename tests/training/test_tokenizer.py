"""Byte-level BPE: training, saving in the AutoTokenizer layout, lossless round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from trtllm_moespec.training.data import encode_documents
from trtllm_moespec.training.tokenizer import EOT_TOKEN, save_pretrained, train_bpe

TEXTS = ["def add(a, b):\n    return a + b\n", "class Foo:\n    '''doc'''\n    x = [1, 2, 3]\n", "print('héllo wörld ✓')\n"] * 20
SHIPPED = Path(__file__).resolve().parents[2] / "trtllm_moespec" / "assets" / "moespec-tiny" / "target"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    save_pretrained(train_bpe(TEXTS, vocab_size=300), out)
    return out


def test_autotokenizer_roundtrip(tok_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok.eos_token == tok.bos_token == tok.pad_token == EOT_TOKEN and tok.eos_token_id == 0
    text = "def f(x):\n\treturn x ** 2  # ünïcode ✓ 🐍\n"  # bytes never seen in training still round-trip
    ids = tok(text)["input_ids"]
    assert tok.eos_token_id not in ids
    assert tok.decode(ids) == text


def test_document_separator(tok_dir: Path) -> None:
    from trtllm_moespec.training.tokenizer import load_tokenizer

    stream = encode_documents(load_tokenizer(tok_dir), ["a = 1\n", "b = 2\n"])
    assert (stream == 0).sum() == 2 and stream[-1] == 0


def test_bad_vocab_size() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(TEXTS, vocab_size=100)


def test_shipped_tokenizer_roundtrip() -> None:
    assert (SHIPPED / "tokenizer.json").is_file(), f"shipped tokenizer missing at {SHIPPED}"
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    source = Path(__file__).read_text()
    assert tok.decode(tok(source)["input_ids"]) == source
    assert len(tok) == 4096
