"""Engine-directory builds (dry run) for the four presets, schema validation, bad inputs."""

import json

import pytest
import yaml

from trtllm_moespec.backends.trtllm import build
from trtllm_moespec.backends.trtllm.config import load_engine_spec
from trtllm_moespec.backends.trtllm.presets import PRESETS, resolve_model
from trtllm_moespec.backends.trtllm.profile import interpolate_costs
from trtllm_moespec.backends.trtllm.schema import validate_llm_api_options
from trtllm_moespec.backends.trtllm.version import trtllm_available
from trtllm_moespec.core.presets import ARCHITECTURES


def hf_config(preset):
    """config.json as the Hub checkpoint names its fields."""
    common = {
        "architectures": [preset.architecture],
        "num_hidden_layers": preset.num_layers,
        "hidden_size": preset.hidden_size,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.head_dim,
        "vocab_size": preset.vocab_size,
        "num_experts_per_tok": preset.experts_per_token,
    }
    if preset.architecture == "GptOssForCausalLM":
        return {**common, "num_local_experts": preset.num_experts, "intermediate_size": preset.moe_intermediate_size,
                "sliding_window": preset.sliding_window}
    return {**common, "num_experts": preset.num_experts, "moe_intermediate_size": preset.moe_intermediate_size,
            "use_sliding_window": False, "sliding_window": None}


def eagle3_config(preset, width=None):
    """An EAGLE-3 drafter config.json (SpecForge names) for a target preset."""
    hidden = width or preset.hidden_size
    return {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden, "intermediate_size": 4 * hidden,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 1,
            "vocab_size": preset.vocab_size, "draft_vocab_size": 32000, "target_hidden_size": preset.hidden_size
            if width is None else width}


@pytest.fixture
def dirs(tmp_path):
    def make(name, cfg):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    drafts = {name: make(f"draft-{name}", eagle3_config(p)) for name, p in PRESETS.items()}
    drafts["narrow"] = make("draft-narrow", eagle3_config(PRESETS["qwen3-30b-a3b"], width=256))
    drafts["postnorm"] = make("draft-postnorm", {**eagle3_config(PRESETS["qwen3-30b-a3b"]),
                                                 "eagle_config": {"return_hidden_post_norm": True}})
    drafts["normout"] = make("draft-normout", {**eagle3_config(PRESETS["qwen3-30b-a3b"]), "norm_output": True})
    ckpts = {name: make(f"ckpt-{name}", hf_config(p)) for name, p in PRESETS.items()}
    return tmp_path, drafts, ckpts


def run(argv, capsys):
    rc = build.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dry_run_writes_a_valid_engine_dir(name, dirs, capsys):
    tmp, drafts, ckpts = dirs
    draft = drafts[name]
    out = tmp / f"engine-{name}"
    rc, stdout, err = run(["--model", name, "--checkpoint", ckpts[name], "--draft-model", draft, "--policy", "evict",
                           "--verify-lengths", "32,4,8,16", "--max-batch-size", "6", "--out", out, "--dry-run"], capsys)
    assert rc == 0, err
    assert "dry run" in stdout and "cost_profile.json" in stdout
    spec = load_engine_spec(out)
    assert [p.verify_length for p in spec.profiles] == [4, 8, 16, 32]
    assert spec.cost_profile is None and spec.dry_run and not (out / "cost_profile.json").exists()
    preset = PRESETS[name]
    # what the engine really needs: the dynamic-tree line for tree engines, 1.2 or later for chain ones (F14)
    assert spec.versions["tensorrt_llm_range"] == (">=1.2.0,<2.0.0" if preset.has_sliding_window
                                                   else ">=1.3.0.dev0,<2.0.0")
    for p in spec.profiles:
        options = yaml.safe_load((out / p.options_yaml).read_text())
        validate_llm_api_options(options)
        sc = options["speculative_config"]
        assert sc["decoding_type"] == "Eagle3" and sc["max_total_draft_tokens"] == p.verify_length
        assert sc["speculative_model_dir"] == str(draft.resolve())
        assert sc["eagle3_layers_to_capture"] == [1, preset.num_layers // 2 - 1, preset.num_layers - 4]
        assert options["cuda_graph_config"]["batch_sizes"] == [1, 2, 4, 6]
        assert options["tensor_parallel_size"] == preset.recommended_tp
        if preset.has_sliding_window:  # GPT-OSS: chain mode
            assert sc["use_dynamic_tree"] is False and sc["max_draft_len"] == p.verify_length
        else:
            assert sc["use_dynamic_tree"] is True and sc["dynamic_tree_max_topK"] == 8
            assert sc["max_draft_len"] == min(4, p.verify_length)
    main = yaml.safe_load((out / "llm_api_options.yaml").read_text())
    assert main["speculative_config"]["max_total_draft_tokens"] == 32
    readme = (out / "README.md").read_text()
    assert ("sliding-window" in readme) == preset.has_sliding_window and "DRY RUN" in readme
    assert spec.mode == ("chain" if preset.has_sliding_window else "tree")


def test_local_hf_directory_as_model(dirs, capsys):
    tmp, drafts, ckpts = dirs
    rc, _, err = run(["--model", ckpts["qwen3-30b-a3b"], "--draft-model", drafts["qwen3-30b-a3b"], "--out", tmp / "e", "--dry-run"], capsys)
    assert rc == 0, err
    spec = load_engine_spec(tmp / "e")
    assert spec.checkpoint == str(ckpts["qwen3-30b-a3b"].resolve()) and spec.model.num_experts == 128
    assert [p.verify_length for p in spec.profiles] == [32]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--model", "llama-70b"], "unknown model preset"),
        (["--checkpoint", "{tmp}/nope"], "does not exist"),
        (["--draft-model", "{tmp}/nope"], "draft model"),
        (["--verify-lengths", "0,8"], "must be positive"),
        (["--verify-lengths", "-4"], "must be positive"),
        (["--verify-lengths", "8,33"], "exceeds the tree's max_draft_tokens=32"),
        (["--verify-lengths", "eight"], "not an integer"),
        (["--tp", "8", "--ep", "3"], "must divide --tp 8"),
        (["--tp", "256", "--ep", "256"], "must divide the model's 128 experts"),
        (["--checkpoint", "{gptoss}"], "does not match preset"),
        (["--max-draft-tokens", "64"], "exceeds steps*topk=32"),
        # issue 13: a drafter of the wrong width, the target directory given as the drafter, a bad policy
        (["--draft-model", "{narrow}"], "target of hidden size 256"),
        (["--draft-model", "{gptoss_draft}"], "target of hidden size 2880"),
        (["--draft-model", "{target}"], "not an EAGLE-3 drafter config"),
        (["--policy", "medusa"], "invalid choice"),
        # issue 26: GPT-OSS asserts pp_size == 1 in TensorRT-LLM (F7); post-norm drafters (F10)
        (["--model", "gpt-oss-20b", "--checkpoint", "{gptoss}", "--draft-model", "{gptoss20_draft}", "--pp", "2"],
         "does not support pipeline parallelism"),
        (["--draft-model", "{postnorm}"], "returns post-norm hidden states"),
        (["--draft-model", "{normout}"], "returns post-norm hidden states"),
        (["--moe-backend", "FAST"], "invalid choice"),
    ],
)
def test_bad_input_exits_2_with_one_line(extra, message, dirs, capsys):
    tmp, drafts, ckpts = dirs
    argv = {"--model": "qwen3-30b-a3b", "--checkpoint": str(ckpts["qwen3-30b-a3b"]),
            "--draft-model": str(drafts["qwen3-30b-a3b"]),
            "--out": str(tmp / "bad")}
    for key, value in zip(extra[::2], extra[1::2]):
        argv[key] = value.format(tmp=tmp, gptoss=ckpts["gpt-oss-20b"], target=ckpts["qwen3-30b-a3b"],
                                 narrow=drafts["narrow"], gptoss_draft=drafts["gpt-oss-120b"],
                                 gptoss20_draft=drafts["gpt-oss-20b"], postnorm=drafts["postnorm"],
                                 normout=drafts["normout"])
    if "--policy" in extra or "--moe-backend" in extra:  # argparse's own exit
        with pytest.raises(SystemExit) as exc:
            run([x for kv in argv.items() for x in kv] + ["--dry-run"], capsys)
        assert exc.value.code == 2 and message in capsys.readouterr().err
        return
    rc, _, err = run([x for kv in argv.items() for x in kv] + ["--dry-run"], capsys)
    assert rc == 2
    assert message in err and err.strip().count("\n") == 0 and err.startswith("moespec build: error:")
    assert not (tmp / "bad" / "moespec.json").exists()


@pytest.mark.skipif(trtllm_available(), reason="tensorrt_llm is installed: the real build path would run")
def test_real_build_without_tensorrt_llm_exits_nonzero(dirs, capsys):
    tmp, drafts, ckpts = dirs
    rc, _, err = run(["--model", "gpt-oss-20b", "--checkpoint", ckpts["gpt-oss-20b"], "--draft-model", drafts["gpt-oss-20b"],
                      "--out", tmp / "real"], capsys)
    assert rc == 1 and "tensorrt_llm is not importable" in err and err.strip().count("\n") == 0
    assert not (tmp / "real").exists()


def test_real_build_checks_the_installed_line_before_writing(dirs, capsys, monkeypatch):
    """F8: a tree engine on an installed 1.2.x fails in one line, and nothing is written."""
    from trtllm_moespec.backends.trtllm import version

    tmp, drafts, ckpts = dirs
    monkeypatch.setattr(build, "trtllm_available", lambda: True)
    monkeypatch.setattr(version, "installed_version", lambda: "1.2.3")
    monkeypatch.setattr(version, "dynamic_tree_available", lambda: False)
    rc, _, err = run(["--model", "qwen3-30b-a3b", "--checkpoint", ckpts["qwen3-30b-a3b"], "--draft-model",
                      drafts["qwen3-30b-a3b"], "--out", tmp / "real"], capsys)
    assert rc == 1 and "tensorrt_llm 1.2.3 does not have" in err and err.strip().count("\n") == 0
    assert not (tmp / "real").exists()
    monkeypatch.setattr(version, "installed_version", lambda: "2.1.0")  # a GPT-OSS chain engine: outside its range
    rc, _, err = run(["--model", "gpt-oss-20b", "--checkpoint", ckpts["gpt-oss-20b"], "--draft-model",
                      drafts["gpt-oss-20b"], "--out", tmp / "real"], capsys)
    assert rc == 1 and "2.1.0 is not supported" in err and not (tmp / "real").exists()


def test_moe_backend_for_gpt_oss_on_hopper(dirs, capsys):
    """F15: moe_config.backend (TRITON, CUTLASS, ...) reaches every profile."""
    tmp, drafts, ckpts = dirs
    rc, _, err = run(["--model", "gpt-oss-120b", "--checkpoint", ckpts["gpt-oss-120b"], "--draft-model",
                      drafts["gpt-oss-120b"], "--moe-backend", "TRITON", "--verify-lengths", "4,8", "--out",
                      tmp / "oss", "--dry-run"], capsys)
    assert rc == 0, err
    spec = load_engine_spec(tmp / "oss")
    assert spec.moe_backend == "TRITON"
    for p in spec.profiles:
        options = yaml.safe_load((tmp / "oss" / p.options_yaml).read_text())
        assert options["moe_config"] == {"backend": "TRITON"}
    with pytest.raises(ValueError, match="moe_config.backend"):
        validate_llm_api_options({"moe_config": {"backend": "FAST"}})


def test_real_build_needs_a_checkpoint(dirs, capsys):
    tmp, drafts, _ = dirs
    rc, _, err = run(["--model", "gpt-oss-120b", "--draft-model", drafts["gpt-oss-120b"], "--out", tmp / "x"], capsys)
    assert rc == 2 and "--checkpoint" in err


def test_presets_agree_with_core_architectures_and_capture_layers():
    for name, preset in PRESETS.items():
        arch = ARCHITECTURES[name]
        assert (preset.num_layers, preset.hidden_size, preset.num_experts, preset.experts_per_token,
                preset.moe_intermediate_size, preset.vocab_size, preset.sliding_window) == (
            arch.num_layers, arch.hidden_size, arch.num_experts, arch.top_k, arch.moe_intermediate_size,
            arch.vocab_size, arch.sliding_window)
    assert PRESETS["qwen3-30b-a3b"].eagle3_capture_layers == (2, 24, 45)
    assert PRESETS["qwen3-235b-a22b"].trtllm_layers_to_capture == [1, 46, 90]
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(".")


def test_schema_rejects_unknown_and_inconsistent_fields():
    good = {"speculative_config": {"decoding_type": "Eagle3", "speculative_model_dir": "/d", "max_draft_len": 4,
                                   "max_total_draft_tokens": 32, "use_dynamic_tree": True, "dynamic_tree_max_topK": 8}}
    validate_llm_api_options(good)
    with pytest.raises(ValueError, match="unknown TensorRT-LLM field"):
        validate_llm_api_options({**good, "tensor_paralel_size": 2})
    with pytest.raises(ValueError, match="must lie in"):
        validate_llm_api_options({"speculative_config": {**good["speculative_config"], "max_total_draft_tokens": 33}})
    with pytest.raises(ValueError, match="linear"):
        validate_llm_api_options({"speculative_config": {**good["speculative_config"], "use_dynamic_tree": False}})
    with pytest.raises(ValueError, match="max_batch_size must equal"):
        validate_llm_api_options({"cuda_graph_config": {"batch_sizes": [1, 2], "max_batch_size": 4}})


def test_interpolate_costs():
    assert interpolate_costs({0: 1.0, 4: 2.0, 8: 4.0}, 8) == (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0)
    with pytest.raises(ValueError, match="k=0"):
        interpolate_costs({4: 1.0}, 4)


def test_policy_ddd_and_eager_policies_and_the_1_2_line(dirs, capsys):
    """ddd is accepted (TensorRT-LLM's worker runs eagle3 for it); coverage selects eagerly, so its
    profiles disable CUDA graphs; --trtllm-line 1.2 writes linear profiles (1.2.x has no dynamic tree)."""
    tmp, drafts, ckpts = dirs
    common = ["--model", "qwen3-30b-a3b", "--checkpoint", ckpts["qwen3-30b-a3b"],
              "--draft-model", drafts["qwen3-30b-a3b"], "--verify-lengths", "8,16", "--dry-run"]
    assert run(common + ["--policy", "ddd", "--out", tmp / "ddd"], capsys)[0] == 0
    main = yaml.safe_load((tmp / "ddd" / "llm_api_options.yaml").read_text())
    assert main["cuda_graph_config"]["enable_padding"] is True
    assert run(common + ["--policy", "coverage", "--out", tmp / "cov"], capsys)[0] == 0
    for path in (tmp / "cov").rglob("*.yaml"):
        assert yaml.safe_load(path.read_text())["cuda_graph_config"] is None
    assert "cuda_graph_config: null" in (tmp / "cov" / "README.md").read_text()
    assert run(common + ["--policy", "eagle3", "--trtllm-line", "1.2", "--out", tmp / "old"], capsys)[0] == 0
    spec = load_engine_spec(tmp / "old")
    assert spec.mode == "chain" and spec.versions["tensorrt_llm_range"] == ">=1.2.0,<2.0.0"
    for p in spec.profiles:
        sc = yaml.safe_load((tmp / "old" / p.options_yaml).read_text())["speculative_config"]
        assert sc["use_dynamic_tree"] is False and sc["max_draft_len"] == sc["max_total_draft_tokens"] == p.verify_length
    assert run(common + ["--policy", "eagle3", "--topk", "1", "--steps", "16", "--max-draft-tokens", "16", "--out", tmp / "k1"], capsys)[0] == 0
    assert load_engine_spec(tmp / "k1").mode == "chain"  # topK 1 is linear on main (_is_effective_dynamic_tree)


def _cli(*args, cwd=None):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, "-m", "trtllm_moespec.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env={**os.environ, "PYTHONPATH": str(repo)})


def test_cli_build_rejects_a_foreign_drafter_in_one_line(dirs):
    """issue 13, the real command: `moespec build --model qwen3-30b-a3b --draft-model <target dir> --dry-run`."""
    tmp, drafts, ckpts = dirs
    for draft in (ckpts["qwen3-30b-a3b"], drafts["gpt-oss-120b"]):
        run_ = _cli("build", "--model", "qwen3-30b-a3b", "--checkpoint", ckpts["qwen3-30b-a3b"], "--draft-model", draft,
                    "--out", tmp / "x", "--dry-run")
        assert run_.returncode == 2 and run_.stderr.startswith("moespec build: error: draft model")
        assert run_.stderr.strip().count("\n") == 0 and not (tmp / "x").exists()


def test_cli_triton_repo_has_a_description_and_prefixed_errors(tmp_path):
    helped = _cli("triton-repo", "--help")
    assert helped.returncode == 0 and "Triton Inference Server model repository" in helped.stdout
    failed = _cli("triton-repo", "--engine-dir", tmp_path / "none", "--out", tmp_path / "r")
    assert failed.returncode == 2 and failed.stderr.startswith("moespec triton-repo: error:")
    assert failed.stderr.strip().count("\n") == 0


def test_readme_build_line_runs_as_written(dirs, tmp_path):
    """The documented `moespec build` line (README.md or docs/tensorrt_llm.md, where the README moved it), with
    --dry-run appended and the placeholders filled, works."""
    import re
    import shlex
    from pathlib import Path

    tmp, drafts, ckpts = dirs
    root = Path(__file__).resolve().parents[2]
    readme = "\n".join((root / name).read_text() for name in ("README.md", "docs/tensorrt_llm.md")
                        if (root / name).is_file())
    line = next(x for x in readme.splitlines() if x.startswith("moespec build"))
    assert "--checkpoint" in line and "--dry-run" in readme
    args = shlex.split(line)[2:]
    fill = {"CKPT": ckpts["gpt-oss-120b"], "DRAFT": drafts["gpt-oss-120b"], "E": tmp_path / "E"}
    args = [str(fill.get(a, a)) for a in args]
    assert not [a for a in args if re.fullmatch(r"[A-Z]+", a)], f"unfilled placeholders in {line!r}"
    run_ = _cli("build", *args, "--dry-run")
    assert run_.returncode == 0, run_.stderr
