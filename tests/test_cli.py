"""The real `moespec` command on bad input: one line on stderr, exit code 2, nothing echoed or lost.

Every case runs the installed command (or `python -m trtllm_moespec.cli`) in a subprocess. The
subprocesses of the table-driven cases start together (a few at a time) in one module fixture, so
the cases cost about as much wall time as the slowest few; most fail before torch is imported.
The cases are listed, with the API and bench ones, in `tests/bad_input_cases.py`, which renders
`docs/bad_inputs.md`; the last tests here keep the two in step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.bad_input_cases import CASES, markdown
from tests.engine.conftest import make_checkpoint, make_tokenized_checkpoint

REPO = Path(__file__).resolve().parents[1]


def moespec_command() -> list[str]:
    exe = shutil.which("moespec")
    return [exe] if exe else [sys.executable, "-m", "trtllm_moespec.cli"]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _with_default_sigint(command: list[str]) -> list[str]:
    """`command` started with Ctrl-C at its default action, as from a terminal. A test runner started in
    the background by a non-interactive shell ignores SIGINT, and an ignored signal stays ignored across
    exec (Python then installs no KeyboardInterrupt handler): a one-line trampoline resets it first."""
    reset = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    exe = shutil.which(command[0]) or command[0]
    return [sys.executable, "-c", reset, exe] + command[1:]


def run_moespec(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(moespec_command() + args, capture_output=True, text=True, timeout=timeout, env=_env())


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny random checkpoints (good and broken), cost profiles and prompt files."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("cli")
    target, draft = make_checkpoint(root, "qwen3_moe")  # vocab 128, no tokenizer, cost profile for 4,8,32
    f = {"root": root, "target": target, "draft": draft}

    missing = root / "missing"
    shutil.copytree(target, missing)
    weights = load_file(str(missing / "model.safetensors"))
    del weights["model.layers.0.self_attn.q_proj.weight"]
    save_file(weights, str(missing / "model.safetensors"), metadata={"format": "pt"})
    f["missing"] = missing

    hidden = root / "hidden"
    shutil.copytree(target, hidden)
    config = json.loads((hidden / "config.json").read_text())
    (hidden / "config.json").write_text(json.dumps(dict(config, hidden_size=96)))
    f["hidden"] = hidden

    tok = make_tokenized_checkpoint(root)  # moespec-tiny's tokenizer, random weights, 512-token context
    f["tok"] = tok

    (root / "empty").mkdir()
    f["empty"] = root / "empty"
    pickle = root / "pickle"
    pickle.mkdir()
    shutil.copy(target / "config.json", pickle / "config.json")
    (pickle / "pytorch_model.bin").write_bytes(b"not loaded")
    f["pickle"] = pickle
    listed = root / "listed"
    shutil.copytree(target, listed)
    (listed / "config.json").write_text("[1, 2]")
    f["listed"] = listed
    for name, file, text in (("badgen", "generation_config.json", '{"eos_token_id": [1,'),
                             ("badeos", "generation_config.json", '{"eos_token_id": "</s>"}'),
                             ("badtok", "tokenizer.json", '{"version": "1.0", "trunc')):
        shutil.copytree(tok if name == "badtok" else target, root / name)
        (root / name / file).write_text(text)
        f[name] = root / name

    profile = json.loads((target / "cost_profile.json").read_text())
    (root / "em.json").write_text(json.dumps(dict(profile, expert_model={"c0": "x"})))
    (root / "costs.json").write_text(json.dumps(dict(profile, costs="abc")))
    f["em_profile"], f["costs_profile"] = root / "em.json", root / "costs.json"
    tuned = root / "tuned"
    shutil.copytree(target, tuned)
    entry = {"options": {"gamma": 5}, "tree": [4, 8, 32], "device": "cpu"}
    (tuned / "policy_defaults.json").write_text(json.dumps(
        {"format": "moespec-policy-defaults/1", "model_id": "tuned", "policies": {"eagle3": entry}}))
    f["tuned"] = tuned

    (root / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (root / "long.txt").write_text("def f(x):\n    return x + 1\n" * 150)  # > 512 tokens
    f["latin1"], f["long"] = root / "latin1.txt", root / "long.txt"
    return f


# id -> (argv with {placeholders} from `files`, regex the one stderr line must match)
CLI_CASES = {
    "prompt-and-prompt-file": (["generate", "--prompt", "a", "--prompt-file", "{latin1}"],
                               r"--prompt-file: not allowed with argument --prompt"),
    "policy-choice": (["generate", "--policy", "fastest"], r"invalid choice: 'fastest' \(choose from 'ar', "),
    "device-tpu": (["generate", "--device", "tpu"], r"unknown device 'tpu'"),
    "seed-huge": (["generate", "--seed", "99999999999999999999999"], r"--seed: must be an integer in \[0, 2\*\*64\)"),
    "tree-over-nodes": (["generate", "--policy", "eagle3", "--tree", "4,8,100000"],
                        r"max_draft_tokens 100000 exceeds the 200 nodes the tree drafts"),
    "tree-too-big": (["generate", "--policy", "eagle3", "--tree", "4,10000,32"],
                     r"drafts .* = 300010000 nodes per step; the limit is 4096"),
    "dtype-int8": (["generate", "--dtype", "int8"], r"--dtype: invalid choice: 'int8'"),
    "max-tokens-zero": (["generate", "--max-tokens", "0"], r"--max-tokens: must be an integer >= 1, got 0"),
    "structured-bad-regex": (["generate", "--regex", "("],
                             r"cannot compile the regex constraint: Regex parsing error at position 2"),
    "penalty-out-of-range": (["generate", "--presence-penalty", "3"],
                             r"--presence-penalty must be a number in \[-2, 2\], got 3\.0"),
    "threads-out-of-range": (["generate", "--threads", "0"], r"--threads: must be an integer >= 1, got 0"),
    "prompt-file-directory": (["generate", "--prompt-file", "{root}"], r"--prompt-file .* is a directory"),
    "prompt-file-not-utf8": (["generate", "--prompt-file", "{latin1}"],
                             r"--prompt-file .*latin1\.txt is not UTF-8 text \(byte 3"),
    "prompt-file-missing": (["generate", "--prompt-file", "{root}/nope.txt"],
                            r"--prompt-file .*nope\.txt cannot be read: No such file"),
    "model-before-profile": (["generate", "--model", "{empty}"], r"target checkpoint has no config\.json"),
    "pickle-before-profile": (["generate", "--model", "{pickle}"], r"only pickle weights"),
    "config-not-object": (["generate", "--model", "{listed}", "--policy", "ar"],
                          r"config\.json must hold a JSON object, got list"),
    "profile-expert-model-field": (
        ["generate", "--model", "{target}", "--draft-model", "{draft}", "--predictor", "oracle",
         "--cost-profile", "{em_profile}"], r"cost profile .*em\.json: field 'expert_model\.c0' must be a number"),
    "profile-costs-field": (
        ["generate", "--model", "{target}", "--draft-model", "{draft}", "--policy", "evict",
         "--cost-profile", "{costs_profile}"], r"cost profile .*costs\.json: field 'costs' must be a list of numbers"),
    "policy-defaults-unknown-option": (
        ["generate", "--model", "{tuned}", "--draft-model", "{draft}", "--policy", "eagle3"],
        r"policy defaults .*tuned/policy_defaults\.json, policy 'eagle3': unknown options \['gamma'\]"),
    "tree-topk-over-vocab": (["generate", "--model", "{target}", "--draft-model", "{draft}", "--policy", "eagle3",
                              "--tree", "1,200,8"], r"tree topk 200 exceeds the drafter's vocabulary of 128 tokens"),
    "missing-tensor": (["generate", "--model", "{missing}", "--policy", "ar"],
                       r"missing 1 tensor\(s\) the model needs: model\.layers\.0\.self_attn\.q_proj\.weight"),
    "hidden-size-mismatch": (["generate", "--model", "{hidden}", "--policy", "ar"],
                             r"does not match its config\.json: .* config\.json implies"),
    "prompt-too-long": (["generate", "--model", "{tok}", "--policy", "ar", "--prompt-file", "{long}"],
                        r"prompt of \d+ tokens plus --max-tokens 64 exceeds the model's context of 512 tokens"),
    "max-tokens-huge": (["generate", "--model", "{tok}", "--policy", "ar", "--prompt", "hello",
                         "--max-tokens", "1000000000"], r"--max-tokens 1000000000 exceeds the model's context"),
    # issue 27: flags, not Python arguments; files checked before the long work; broken JSON files named
    "cli-names-flags": (["generate", "--model", "{target}", "--policy", "eagle3"],
                        r"no draft model was given: pass --draft-model DIR \(SpecForge format\) or --drafter ngram$"),
    "generation-config-broken": (["generate", "--model", "{badgen}", "--policy", "ar"],
                                 r"badgen/generation_config\.json is not valid JSON \(line 1 column \d+"),
    "generation-config-eos": (["generate", "--model", "{badeos}", "--policy", "ar"],
                              r"badeos/generation_config\.json: eos_token_id must be a token id or a list"),
    "tokenizer-json-broken": (["generate", "--model", "{badtok}", "--policy", "ar"],
                              r"badtok/tokenizer\.json is not valid JSON \(line 1 column \d+"),
    "profile-out-unwritable": (["profile", "--model", "{target}", "--draft-model", "{draft}", "--out",
                                "/sys/moespec/p.json"], r"--out /sys/moespec/p\.json: cannot create files in /sys"),
    "bench-output-unwritable": (["bench", "--model", "{target}", "--draft-model", "{draft}", "--json",
                                 "/sys/moespec/r.json"], r"--json /sys/moespec/r\.json: cannot create files in /sys"),
    "replay-out-unwritable": (["replay", "record", "--model", "{target}", "--out", "/sys/moespec/r.safetensors"],
                              r"--out /sys/moespec/r\.safetensors: cannot create files in /sys"),
}


@pytest.fixture(scope="module")
def cli_results(files):
    """Run every table case at once (4 at a time); id -> CompletedProcess."""
    argvs = {case: [a.format(**files) for a in argv] for case, (argv, _) in CLI_CASES.items()}
    with ThreadPoolExecutor(4) as pool:
        futures = {case: pool.submit(run_moespec, argv) for case, argv in argvs.items()}
        return {case: fut.result() for case, fut in futures.items()}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_bad_input_is_one_line_and_exit_2(case, cli_results):
    out = cli_results[case]
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (case, out.returncode, out.stderr[-2000:])
    assert len(lines) == 1, (case, out.stderr[-2000:])
    assert re.search(CLI_CASES[case][1], lines[0]), (case, lines[0])
    assert lines[0].startswith("moespec"), lines[0]
    assert out.stdout == "", (case, out.stdout[:200])  # nothing echoed before the error (the prompt included)


# ------------------------------------------------------------------------------- special cases
def test_broken_pipe_exits_quietly(files):
    """`moespec generate | head -c 1`: stop without a BrokenPipeError traceback (case broken-pipe)."""
    proc = subprocess.Popen(moespec_command() + ["generate", "--model", str(files["tok"]), "--policy", "ar",
                                                 "--prompt", "hello", "--max-tokens", "400"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    assert proc.stdout.read(1)
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141, err.decode()[-2000:]
    assert b"Traceback" not in err and b"Exception ignored" not in err, err.decode()[-2000:]


def test_bench_ctrl_c_twice_keeps_a_finished_report(files, tmp_path):
    """Ctrl-C twice during `moespec bench --json r.json` with a finished r.json there: r.json is untouched,
    the partial report goes to r.partial.json, exit 130, no traceback (case bench-ctrl-c-keeps-report)."""
    good = {"schema": "moespec-bench/1", "status": "complete", "results": [{"method": "ar"}]}
    report = tmp_path / "r.json"
    report.write_text(json.dumps(good))
    proc = subprocess.Popen(_with_default_sigint(moespec_command()) + [
        "bench", "--model", str(files["target"]), "--draft-model", str(files["draft"]), "--tree", "2,4,8",
        "--methods", "ar,eagle3", "--predictor", "oracle", "--num-prompts", "8", "--max-tokens", "32",
        "--json", str(report)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    seen, err = threading.Event(), bytearray()

    def read_stderr():
        for chunk in iter(lambda: proc.stderr.read1(4096), b""):
            err.extend(chunk)
            if b"load methods" in err:
                seen.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    assert seen.wait(240), bytes(err).decode()[-2000:]  # the models are loading
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.stdout.read()
    proc.wait(timeout=240)
    reader.join(10)
    text = bytes(err).decode()
    assert proc.returncode == 130, text[-2000:]
    assert "Traceback" not in text and "Exception ignored" not in text, text[-2000:]
    assert json.loads(report.read_text()) == good
    partial = json.loads((tmp_path / "r.partial.json").read_text())
    assert partial["status"] == "interrupted"
    assert "r.partial.json" in text


def test_generate_help_documents_every_option():
    """(case help-texts) Every `generate` option has help text, --policy and --dtype are closed choices,
    and `bench --help` shows its defaults."""
    from trtllm_moespec.cli import POLICY_CHOICES, build_parser

    parser = build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]
    for action in generate._actions:
        assert action.help, action.option_strings
    out = run_moespec(["generate", "--help"])
    assert out.returncode == 0
    assert "{ar,coverage,ddd,eagle3,ecospec,evict,joint,oracle}" in out.stdout and "(default: joint)" in out.stdout
    bench = run_moespec(["bench", "--help"])
    assert bench.returncode == 0 and "(default: the model's" in bench.stdout and "(default: 8)" in bench.stdout
    from trtllm_moespec.api import METHODS

    assert tuple(sorted(POLICY_CHOICES)) == tuple(sorted(METHODS))


# ------------------------------------------------------------------------------- the table
def test_docs_table_matches_the_cases():
    doc = REPO / "docs" / "bad_inputs.md"
    assert doc.read_text() == markdown(), "regenerate: python -m tests.bad_input_cases > docs/bad_inputs.md"


def test_every_case_has_a_test():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    sources = "".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    missing = [i for i in ids if i not in CLI_CASES and f"case {i}" not in sources]
    assert not missing, f"cases without a test (name them as 'case <id>' in the covering test): {missing}"
