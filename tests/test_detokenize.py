"""Incremental detokenization (`trtllm_moespec/detokenize.py`) on the real moespec-tiny byte-level
tokenizer and on a SentencePiece-style decode: the incremental text equals the full decode after every
token, for real text and for random token sequences (partial and invalid UTF-8 included), after a cut,
and the stop-string check cuts where the full-decode rule cuts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_moespec.detokenize import IncrementalText, TextStream, stop_string_check


@pytest.fixture(scope="module")
def decode():
    from transformers import AutoTokenizer

    from trtllm_moespec.resolve import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("moespec-tiny", None, None).target))
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True), tokenizer


def _check_every_prefix(text: IncrementalText, decode, ids: list[int]) -> None:
    for n in range(len(ids) + 1):
        assert text.text(ids[:n]) == decode(ids[:n]), n


def test_incremental_text_equals_the_full_decode_on_real_text(decode):
    decode, tokenizer = decode
    ids = tokenizer.encode("def f(x):\n    return 'naïve café 日本語 🙂🎉' + x  # → done\n", add_special_tokens=False)
    text = IncrementalText(decode)
    _check_every_prefix(text, decode, ids)
    assert text.local  # the windows never disagreed: the fast path ran throughout


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_incremental_text_equals_the_full_decode_on_random_tokens(decode, seed):
    """Random ids split multi-byte characters anywhere and make invalid UTF-8; cuts (a stop string)
    shorten the list between growths."""
    decode, tokenizer = decode
    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(0, tokenizer.vocab_size, int(rng.integers(1, 40)))]
    text = IncrementalText(decode)
    n = 0
    while n < len(ids):
        n = min(len(ids), n + int(rng.integers(1, 4)))
        if rng.random() < 0.15:
            n = int(rng.integers(0, n + 1))  # cut
        assert text.text(ids[:n]) == decode(ids[:n])
        if n == 0:
            n = 1


def test_a_decode_that_drops_the_first_leading_space_stays_exact():
    """SentencePiece drops the leading space of a decode's first token: the windows both start with
    the same token, so what they differ by is the new tokens' text."""
    pieces = {0: "\u2581the", 1: "\u2581cat", 2: "s", 3: "\u2581sat", 4: ".", 5: "\u2581on"}

    def decode(ids):
        return "".join(pieces[i] for i in ids).replace("\u2581", " ").removeprefix(" ")
    ids = [0, 1, 2, 3, 5, 0, 1, 4]
    text = IncrementalText(decode)
    _check_every_prefix(text, decode, ids)
    assert text.local


def test_a_decode_that_is_not_local_falls_back_to_decoding_everything():
    """A tokenizer that rewrites " ." as "." across tokens: a window can disagree with its prefix;
    the text stays exact (decoded whole from then on)."""
    pieces = {0: "a", 1: " ", 2: ".", 3: "b"}

    def decode(ids):
        return "".join(pieces[i] for i in ids).replace(" .", ".")
    ids = [0, 1, 3, 1, 2, 3, 1, 1, 2]
    text = IncrementalText(decode)
    _check_every_prefix(text, decode, ids)
    assert not text.local


def test_stream_deltas_join_to_the_final_text(decode):
    decode, tokenizer = decode
    ids = tokenizer.encode("x = '🙂 é → 日本' # done", add_special_tokens=False)
    stream = TextStream(decode)
    chunks = [stream.push(ids[:n]) for n in range(1, len(ids) + 1)] + [stream.finish(ids)]
    assert "".join(chunks) == decode(ids) and not any("\ufffd" in c for c in chunks)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_the_stop_check_cuts_where_the_full_decode_rule_cuts(decode, seed):
    """The engine calls the check after every step with the grown output: the first call that finds a
    stop string returns the length the full-decode rule gives (the longest prefix holding none)."""
    decode, tokenizer = decode
    rng = np.random.default_rng(seed)
    words = ["def", " f", "(x)", ":\n", " return", " x", " +", " 1", "🙂", " é", "\n"]
    text = "".join(rng.choice(words, size=30))
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = [str(rng.choice([" return", "x +", "🙂", ":\n ", "zzz"]))]
    check = stop_string_check(decode, stop)
    prev = n = 0
    cut = None
    while n < len(ids) and cut is None:
        prev, n = n, min(len(ids), n + int(rng.integers(1, 4)))  # a step commits 1-3 tokens
        cut = check(ids[:n])
    first = next((k for k in range(1, len(ids) + 1) if any(s in decode(ids[:k]) for s in stop)), None)
    if first is None:
        assert cut is None
    else:
        assert cut is not None and prev < first <= n  # found by the step that completed it
        want = n
        while want > 0 and any(s in decode(ids[:want]) for s in stop):
            want -= 1
        assert cut == want
