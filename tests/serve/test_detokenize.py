"""Streaming text deltas on the real moespec-tiny byte-level tokenizer."""

from __future__ import annotations

import pytest

from trtllm_moespec.detokenize import TextStream


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from trtllm_moespec.resolve import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model("moespec-tiny", None, None).target))


def _decode(tokenizer):
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


def test_deltas_add_up_to_the_text_and_never_split_a_character(tokenizer):
    text = "naïve café — 日本語 🙂🙂 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    stream = TextStream(_decode(tokenizer))
    deltas = [stream.push(ids[:n]) for n in range(1, len(ids) + 1)]
    deltas.append(stream.finish(ids))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_stop_strings_hold_back_a_possible_prefix(tokenizer):
    text = "one two three"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(_decode(tokenizer), stop=("XYZW",))
    sent = "".join(stream.push(ids[:n]) for n in range(1, len(ids) + 1))
    assert sent == text[: len(text) - 3]  # the last 3 characters could start "XYZW"
    assert sent + stream.finish(ids) == text


def test_finish_after_a_cut_sends_only_what_remains(tokenizer):
    ids = tokenizer.encode("alpha beta gamma", add_special_tokens=False)
    stream = TextStream(_decode(tokenizer), stop=("gam",))
    sent = "".join(stream.push(ids[:n]) for n in range(1, len(ids)))
    final = _decode(tokenizer)(ids[:-1])
    assert final.startswith(sent)
    assert sent + stream.finish(ids[:-1]) == final
