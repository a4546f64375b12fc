"""Bad input fails early with a clear error (API: exception; CLI: one line, exit code 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.models.eagle3 import write_random_drafter
from tests.models.conftest import qwen3_moe_config


def test_missing_and_unsupported_checkpoints(tmp_path, checkpoints):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope"), policy="ar")
    dense = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    transformers.Qwen3ForCausalLM(dense).save_pretrained(str(tmp_path / "dense"))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(str(tmp_path / "dense"), policy="ar")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((checkpoints["qwen3_moe"][0] / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(ValueError):
        LLM(str(corrupt), policy="ar")


def test_drafter_that_does_not_match_the_target(tmp_path, checkpoints):
    target, _ = checkpoints["qwen3_moe"]
    other = write_random_drafter(qwen3_moe_config(hidden_size=96, head_dim=24), tmp_path / "wrong", seed=0)
    with pytest.raises(ValueError, match="96"):
        LLM(str(target), draft_model=str(other), policy="eagle3")


def test_policy_prerequisites_are_checked_before_loading(tmp_path, checkpoints):
    target, draft = checkpoints["qwen3_moe"]
    with pytest.raises(ValueError, match="draft model"):
        LLM(str(target), policy="eagle3")
    with pytest.raises(ValueError, match="predictor"):
        LLM(str(target), draft_model=str(draft), policy="ecospec")
    with pytest.raises(ValueError, match="unknown policy"):
        LLM(str(target), policy="fastest")
    with pytest.raises(ValueError, match="moespec profile"):
        LLM(str(target), draft_model=str(draft), policy="evict", cost_profile=str(tmp_path / "none.json"))
    profile = json.loads((target / "cost_profile.json").read_text())
    profile["device"] = "cuda:NVIDIA H200"
    (tmp_path / "h200.json").write_text(json.dumps(profile))
    with pytest.raises(ValueError, match="device"):
        LLM(str(target), draft_model=str(draft), policy="evict", cost_profile=str(tmp_path / "h200.json"))
    LLM(str(target), draft_model=str(draft), policy="evict", cost_profile=str(tmp_path / "h200.json"),
        override_profile=True)


def test_prompts_and_sampling_parameters(checkpoints):
    target, _ = checkpoints["qwen3_moe"]
    llm = LLM(str(target), policy="ar")
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="context"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=10_000))
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        llm.generate([[1, 500]])
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text prompt"])
    for bad in ({"max_tokens": 0}, {"temperature": -0.5}, {"top_p": 0.0}, {"top_k": -2}, {"seed": "x"},
                {"stop": [""]}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_cli_reports_one_line_and_exit_code_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "trtllm_moespec.cli", "generate", "--model", str(tmp_path / "none"),
                          "--policy", "ar"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "not found" in out.stderr


# ------------------------------------------------------------------ issue 13 (see tests/bad_input_cases.py)
TINY = Path(__file__).resolve().parents[2] / "trtllm_moespec" / "assets" / "moespec-tiny"


@pytest.fixture(scope="module")
def tiny_ar():
    return LLM("moespec-tiny", policy="ar")


def test_stream_holds_back_incomplete_characters(tiny_ar):
    """(case stream-utf8) Byte-level BPE splits an emoji into four tokens; streaming token by token must
    not print U+FFFD for the partial bytes, and the chunks must join to the final text."""
    from trtllm_moespec.detokenize import TextStream

    tok = tiny_ar.tokenizer
    text = "x = '🙂 é → 日本' # done"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))  # the case really arises
    stream = TextStream(tiny_ar._decode)
    chunks = [stream.push(ids[:n]) for n in range(1, len(ids) + 1)]
    chunks.append(stream.finish(ids))
    assert "".join(chunks) == text and not any("\ufffd" in c for c in chunks)
    cut = ids[:ids.index(tok.encode("🙂", add_special_tokens=False)[0]) + 2]  # output ends mid-character
    stream = TextStream(tiny_ar._decode)
    chunks = [stream.push(cut[:n]) for n in range(1, len(cut) + 1)] + [stream.finish(cut)]
    assert "".join(chunks) == tok.decode(cut) and chunks[-1] == "\ufffd"  # flushed at the end, as in the final text
    # through the engine: joined events == final text
    events = list(tiny_ar.stream("s = '", SamplingParams(max_tokens=24, temperature=1.0, seed=2)))
    assert "".join(e.text for e in events) == events[-1].output.text


def test_chat_on_moespec_tiny(tiny_ar):
    """(case chat-tiny) moespec-tiny ships no chat template (it is not chat-tuned): chat() says so, and
    works with an explicit template; (case chat-bad-messages) malformed messages are one clear error."""
    messages = [{"role": "user", "content": "write fib"}]
    with pytest.raises(ValueError, match="no chat template"):
        tiny_ar.chat(messages)
    template = "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}# assistant:"
    [out] = tiny_ar.chat(messages, SamplingParams(max_tokens=3), chat_template=template)  # a list, as vLLM's
    assert out.prompt_token_ids == tiny_ar.tokenizer.encode("# user: write fib\n# assistant:", add_special_tokens=False)
    assert len(out.token_ids) == 3
    for bad in ("hello", [], [{"role": "user"}], [{"role": "user", "content": 3}], [messages, []]):
        with pytest.raises(ValueError, match="list of"):
            tiny_ar.chat(bad, chat_template=template)
    # several conversations: decoded together, one output each, as each alone
    other = [{"role": "user", "content": "sort a list"}]
    both = tiny_ar.chat([messages, other], SamplingParams(max_tokens=3), chat_template=template)
    assert [o.token_ids for o in both] == [out.token_ids, tiny_ar.chat(other, SamplingParams(max_tokens=3),
                                                                       chat_template=template)[0].token_ids]
    thinking = "{% if enable_thinking %}/think {% endif %}" + template
    [kwargs] = tiny_ar.chat(messages, SamplingParams(max_tokens=3), chat_template=thinking,
                          chat_template_kwargs={"enable_thinking": True})
    assert kwargs.prompt_token_ids == tiny_ar.tokenizer.encode("/think # user: write fib\n# assistant:",
                                                               add_special_tokens=False)


def test_a_foreign_drafter_is_not_paired_with_the_shipped_head(tmp_path):
    """(case foreign-drafter-joint) A 128-wide drafter with the default joint policy falls back to the
    standalone predictor; (case head-predictor-foreign-drafter) forcing the head on it fails before any
    generation; (case head-predictor-ngram) so does the head with the n-gram drafter."""
    tiny_config = transformers.AutoConfig.from_pretrained(str(TINY / "target"))
    foreign = write_random_drafter(tiny_config, tmp_path / "d128", seed=0, hidden_size=128)
    llm = LLM("moespec-tiny", draft_model=str(foreign))
    assert llm.paths.predictor == TINY / "predictor"
    out = llm.generate(["def f(x):\n"], SamplingParams(max_tokens=4))[0]
    assert len(out.token_ids) == 4
    with pytest.raises(ValueError, match="width 256, but the drafter's is 128"):
        LLM("moespec-tiny", draft_model=str(foreign), predictor=str(TINY / "predictor-head"))
    with pytest.raises(ValueError, match="n-gram drafter has none"):
        LLM("moespec-tiny", drafter="ngram", predictor=str(TINY / "predictor-head"))


def test_api_sets_one_thread_as_the_cli(checkpoints):
    """(case api-threads) LLM(...) sets 1 intra-op thread on CPU unless threads=None; (case
    threads-out-of-range) a thread count outside [1, CPUs] is refused."""
    target, _ = checkpoints["qwen3_moe"]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        LLM(str(target), policy="ar", threads=None)
        assert torch.get_num_threads() == 2
        LLM(str(target), policy="ar")
        assert torch.get_num_threads() == 1
        for bad in (0, 10**6, True, "2"):
            with pytest.raises(ValueError, match="threads must be an integer in"):
                LLM(str(target), policy="ar", threads=bad)
    finally:
        torch.set_num_threads(before)


def test_sampling_params_and_prompts_name_the_bad_field(checkpoints):
    """(case sampling-field-types) (case stop-not-string) (case prompt-float-ids) (case model-not-a-path)"""
    for bad, field in (({"temperature": "hot"}, "temperature"), ({"top_p": "x"}, "top_p"), ({"top_k": True}, "top_k"),
                       ({"max_tokens": True}, "max_tokens"), ({"seed": 2**64}, "seed"), ({"seed": -1}, "seed"),
                       ({"stop": [1]}, "stop strings")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    SamplingParams(seed=2**64 - 1)
    target, _ = checkpoints["qwen3_moe"]
    llm = LLM(str(target), policy="ar")
    with pytest.raises(ValueError, match="list of int token ids"):
        llm.generate([[1.7, 2]])
    with pytest.raises(ValueError, match="model must be a path or 'moespec-tiny', got int 123"):
        LLM(model=123)
    for name, value in (("draft_model", 123), ("cost_profile", 1.5), ("predictor", ["x"]), ("ddd_threshold", "x"),
                        ("policy_options", [("budget", 4)])):  # (case argument-types)
        with pytest.raises(ValueError, match=f"^{name} must be"):
            LLM(str(target), policy="ddd", **{name: value})
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        LLM(str(target), policy="ar", device="tpu")


def test_a_stop_string_sharing_a_token_keeps_the_text_before_it(tiny_ar):
    """(case stop-inside-token) A stop string that begins inside a token (BPE merges "):" into one):
    the text ends where it begins and the token stays in the output, as OpenAI and vLLM end it."""
    from trtllm_moespec import SamplingParams

    full = tiny_ar.generate("def f(x):\n", SamplingParams(max_tokens=16, temperature=0.0))[0]
    pieces = [tiny_ar.tokenizer.decode([t]) for t in full.token_ids]
    # (token i, offset j in it, char): the char's first occurrence in the text is inside token i, not at its start
    i, j, stop = next((i, j, c) for i, piece in enumerate(pieces) for j, c in enumerate(piece)
                      if j > 0 and not c.isspace() and c not in full.text[:len("".join(pieces[:i])) + j])
    out = tiny_ar.generate("def f(x):\n", SamplingParams(max_tokens=16, temperature=0.0, stop=[stop]))[0]
    assert out.text == "".join(pieces[:i]) + pieces[i][:j] and out.token_ids == full.token_ids[:i + 1]
    assert out.finish_reason == "stop"


def test_a_stop_string_completed_by_the_last_token_still_stops(tiny_ar):
    """A stop string completed by the token that also reaches max_tokens (or precedes an eos in the
    same step) still ends the output (finish "stop", the text before it, the tokens through it); the
    check used to be skipped when max_tokens ended the step."""
    from trtllm_moespec import SamplingParams

    full = tiny_ar.generate("def f(x):\n", SamplingParams(max_tokens=12, temperature=0.0))[0]
    stop = full.text.rstrip()[-3:]
    assert stop and full.text.count(stop) == 1, "pick a prompt whose 12-token greedy tail is unique"
    out = tiny_ar.generate("def f(x):\n", SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == full.text[:full.text.index(stop)]
    assert out.token_ids == full.token_ids


def test_a_shared_target_must_be_the_one_the_llm_would_load(tiny_ar):
    """(case target-model-mismatch) `target_model=` shares another LLM's loaded weights (one copy for every
    policy the benchmark compares); one loaded with another dtype or model_impl is refused by name."""
    from trtllm_moespec import LLM, SamplingParams

    shared = LLM(policy="joint", target_model=tiny_ar.target)
    assert shared.target is tiny_ar.target
    params = SamplingParams(max_tokens=12, temperature=0.0)
    assert shared.generate(["def f(x):\n"], params)[0].token_ids == tiny_ar.generate(["def f(x):\n"], params)[0].token_ids
    with pytest.raises(ValueError, match="target_model is not the target this LLM would load: its dtype"):
        LLM(policy="ar", dtype="bfloat16", target_model=tiny_ar.target)
    with pytest.raises(ValueError, match="model_impl lean"):
        LLM(policy="ar", model_impl="hf", target_model=tiny_ar.target)
    with pytest.raises(ValueError, match="target_model must be another LLM's .target"):
        LLM(policy="ar", target_model=tiny_ar)
