"""Incremental detokenization (`trtllm_moespec/detokenize.py`) on the real moespec-tiny byte-level
tokenizer and on a SentencePiece-style decode: the incremental text equals the full decode after every
token, for real text and for random token sequences (partial and invalid UTF-8 included), after a cut,
and the stop-string check cuts where the full-decode rule cuts (OpenAI's: tokens through the
one that completed the stop string, text before it)."""

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


def _reference_cut(decode, ids: list[int], stop: list[str], keep: bool) -> tuple[int, str] | None:
    """The rule from whole decodes: the first token count whose text holds a stop string, and that
    text up to the earliest such string's start (its end with `keep`)."""
    for n in range(1, len(ids) + 1):
        text = decode(ids[:n])
        found = [(text.find(s), -len(s) if keep else 0, s) for s in stop if s in text]
        if found:
            begin, _, s = min(found, key=lambda f: (f[0], len(f[2])))
            return n, text[:begin + len(s)] if keep else text[:begin]
    return None


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_the_stop_check_cuts_where_the_full_decode_rule_cuts(decode, seed, keep):
    """The engine calls the check after every step with the grown output: the first call that finds a
    stop string keeps the tokens through the one that completed it and cuts their text where the
    stop string begins (ends, with include_stop_str_in_output), as whole decodes give."""
    decode, tokenizer = decode
    rng = np.random.default_rng(seed)
    words = ["def", " f", "(x)", ":\n", " return", " x", " +", " 1", "🙂", " é", "\n", ".\n\n", "x."]
    text = "".join(rng.choice(words, size=30))
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = [str(s) for s in rng.choice([" return", "x +", "🙂", ":\n ", "zzz", "\n", ".", "\n\n"],
                                       size=int(rng.integers(1, 3)))]
    check = stop_string_check(decode, stop, keep)
    prev = n = 0
    cut = None
    while n < len(ids) and cut is None:
        prev, n = n, min(len(ids), n + int(rng.integers(1, 4)))  # a step commits 1-3 tokens
        cut = check(ids[:n])
    want = _reference_cut(decode, ids, stop, keep)
    if want is None:
        assert cut is None
        return
    assert cut is not None and prev < cut.num_tokens <= n  # found by the step that completed it
    text = decode(ids[:cut.num_tokens])
    assert (cut.num_tokens, text[:len(text) - cut.trim]) == want


def test_a_stop_string_inside_a_token_cuts_the_text_not_the_token(decode):
    """BPE merges a stop string with its neighbours ("):" is one token here): the token stays in the
    output, and so does its text before the stop string (the old rule dropped the ")")."""
    decode, tokenizer = decode
    ids = tokenizer.encode("def foo(a, b):\n    return a", add_special_tokens=False)
    merged = next(i for i, t in enumerate(ids) if ":" in decode([t]))
    assert decode([ids[merged]]) != ":", "the stop string must share its token with other text"
    cut = stop_string_check(decode, [":"])(ids)
    assert cut.num_tokens == merged + 1
    text = decode(ids[:cut.num_tokens])
    assert text[:len(text) - cut.trim] == "def foo(a, b)"
    stream = TextStream(decode, [":"])
    chunks = [stream.push(ids[:n]) for n in range(1, cut.num_tokens)]
    chunks += [stream.push(ids[:cut.num_tokens], cut.trim), stream.finish(ids[:cut.num_tokens], cut.trim)]
    assert "".join(chunks) == "def foo(a, b)"
    kept = stop_string_check(decode, [":"], keep_stop=True)(ids)
    assert kept.num_tokens == cut.num_tokens and text[:len(text) - kept.trim] == "def foo(a, b):"
