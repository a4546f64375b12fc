"""`moespec bench` on a tiny random Qwen3-MoE + EAGLE-3 drafter: schema, reports, plots, the
T=0 losslessness abort (with a deliberately lossy method) and the partial report on Ctrl-C."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.engine.conftest import make_checkpoint
from trtllm_moespec.bench import main as bench_main
from trtllm_moespec.bench.methods import BASE_METHODS, MethodRunner
from trtllm_moespec.bench.report import RESULT_KEYS
from trtllm_moespec.bench.runner import first_mismatch
from trtllm_moespec.cli import main as cli_main
from trtllm_moespec.core.cost import CostTable, ExpertCostModel

PERCENTILE_KEYS = {"average", "p50", "p90", "p99"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target, draft = make_checkpoint(root, "qwen3_moe")
    profile = root / "profile_2_4_8.json"
    CostTable(tuple(0.010 + 0.001 * k for k in range(9)), model_id="qwen3_moe", device="cpu", dtype="float32",
              tree=(2, 4, 8), method="synthetic (tests)", expert_model=ExpertCostModel(0.010, 0.0005, 0.0002)).save(profile)
    return ["--model", str(target), "--draft-model", str(draft), "--tree", "2,4,8", "--cost-profile", str(profile),
            "--predictor", "oracle", "--no-progress", "--warmup-tokens", "2"]


def test_full_run_schema_markdown_and_plots(model, tmp_path, capsys):
    out = tmp_path / "out"
    rc = bench_main(model + ["--num-prompts", "1", "--max-tokens", "5", "--temperature", "0,1",
                             "--ecospec-global", "--gamma-sweep", "3", "--rho-sweep", "0.5", "--predictor-ablation",
                             "--json", str(out / "r.json"), "--markdown", str(out / "r.md"), "--plots", str(out / "plots")])
    assert rc == 0
    report = json.loads((out / "r.json").read_text())
    assert report["status"] == "complete" and report["error"] is None
    assert report["command"].startswith("moespec bench --model") and "--gamma-sweep 3" in report["command"]
    for key in ("platform", "cpu_count", "torch", "load_average", "load_average_end"):
        assert key in report["machine"]
    labels = list(BASE_METHODS) + ["ecospec[global]", "ecospec[gamma=3]", "ecospec[predictor=oracle]",
                                   "joint[predictor=oracle]", "coverage[rho=0.5]"]
    cells = {(r["dataset"], r["method"], r["temperature"]): r for r in report["results"]}
    assert set(cells) == {(d, m, t) for d in ("humaneval", "mt_bench", "gsm8k") for m in labels for t in (0.0, 1.0)}
    for r in report["results"]:
        assert set(RESULT_KEYS) <= set(r)
        assert set(r["decoding_stats"]) == {"acceptance_length", "num_draft_tokens"}
        assert all(set(v) == PERCENTILE_KEYS for v in r["decoding_stats"].values())
        assert r["num_tokens"] == 5 and r["tokens_per_s"] > 0 and r["speedup_vs_ar"] > 0
    ar = cells[("humaneval", "ar", 0.0)]
    assert ar["speedup_vs_ar"] == 1.0 and ar["verified_tokens"] == 0 and ar["mean_accepted_tokens"] == 1.0
    assert cells[("gsm8k", "eagle3", 1.0)]["speedup_vs_eagle3"] == 1.0
    assert cells[("gsm8k", "eagle3", 0.0)]["verified_tokens"] > 0
    gamma3 = [m for m in report["config"]["methods"] if m["label"] == "ecospec[gamma=3]"][0]
    assert gamma3["policy_options"] == {"budget": 2}  # gamma counts the bonus token
    steps = {(s["dataset"], s["method"], s["temperature"]): s for s in report["steps"]}
    assert len(steps[("mt_bench", "eagle3", 0.0)]["step_ms"]) == cells[("mt_bench", "eagle3", 0.0)]["num_steps"]
    md = (out / "r.md").read_text()
    assert "Table 1" in md and "Table 2" in md and "| eagle3 |" in md and "HumanEval" in md
    for name in ("cost_vs_tree_size.png", "verified_vs_mat.png", "tokens_per_s.png"):
        assert (out / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["status"] == "complete"


def test_the_report_names_the_options_a_model_tuned(model, tmp_path):
    """A method that runs on the model's policy_defaults.json says so; one that set the option itself does not."""
    import shutil

    target = tmp_path / "tuned" / "qwen3_moe"  # the profile's model id is the directory's name
    shutil.copytree(model[1], target)
    entry = {"options": {"budget": 2}, "tree": [2, 4, 8], "device": "cpu"}
    (target / "policy_defaults.json").write_text(json.dumps(
        {"format": "moespec-policy-defaults/1", "model_id": "qwen3_moe", "policies": {"ecospec": entry}}))
    out = tmp_path / "out"
    args = ["--model", str(target)] + model[2:]
    assert bench_main(args + ["--methods", "ar,ecospec", "--gamma-sweep", "5", "--num-prompts", "1", "--max-tokens", "3",
                              "--datasets", "gsm8k", "--json", str(out / "r.json"), "--markdown", str(out / "r.md")]) == 0
    assert json.loads((out / "r.json").read_text())["config"]["tuned_options"] == {"ecospec": {"budget": 2}}
    assert "tuned policy defaults (`policy_defaults.json`): ecospec budget=2." in (out / "r.md").read_text()


def _lossy(monkeypatch, label: str):
    """Make one method drop greedy exactness: its last emitted token is changed."""
    real = MethodRunner.generate

    def generate(self, prompt_ids, params):
        gen = real(self, prompt_ids, params)
        if self.spec.label == label:
            gen.token_ids[-1] = (gen.token_ids[-1] + 1) % self.llm.target.vocab_size
        return gen

    monkeypatch.setattr(MethodRunner, "generate", generate)


def test_t0_mismatch_aborts_loudly(model, tmp_path, monkeypatch, capsys):
    _lossy(monkeypatch, "evict")
    path = tmp_path / "r.json"
    rc = cli_main(["bench"] + model + ["--methods", "ar,eagle3,evict", "--datasets", "gsm8k", "--num-prompts", "1",
                                       "--max-tokens", "4", "--temperature", "0", "--json", str(path)])
    assert rc == 3
    err = capsys.readouterr().err
    assert "T=0 MISMATCH: method 'evict' on gsm8k prompt '0'" in err and "output position 3" in err
    report = json.loads(path.read_text())
    assert report["status"] == "aborted" and "'evict'" in report["error"]
    assert report["results"] == []  # the broken prompt group is not reported as measured


def test_mismatch_is_not_checked_above_temperature_zero(model, monkeypatch):
    _lossy(monkeypatch, "eagle3")
    assert bench_main(model + ["--methods", "ar,eagle3", "--datasets", "gsm8k", "--num-prompts", "1",
                               "--max-tokens", "3", "--temperature", "1"]) == 0


def test_keyboard_interrupt_writes_a_partial_report(model, tmp_path, monkeypatch):
    real, calls = MethodRunner.generate, []

    def generate(self, prompt_ids, params):
        calls.append(self.spec.label)
        if len(calls) == 2 + 4:  # warm-up (2 methods), first prompt group (2), then Ctrl-C in the second group
            raise KeyboardInterrupt
        return real(self, prompt_ids, params)

    monkeypatch.setattr(MethodRunner, "generate", generate)
    out = tmp_path / "partial"
    rc = bench_main(model + ["--methods", "ar,eagle3", "--datasets", "humaneval", "--num-prompts", "3",
                             "--max-tokens", "3", "--temperature", "0", "--json", str(out / "r.json"),
                             "--markdown", str(out / "r.md"), "--plots", str(out / "plots")])
    assert rc == 130
    report = json.loads((out / "r.json").read_text())
    assert report["status"] == "interrupted" and report["completed_prompt_groups"] == 1
    assert {(r["method"], r["num_prompts"]) for r in report["results"]} == {("ar", 1), ("eagle3", 1)}
    assert "interrupted" in (out / "r.md").read_text()
    assert (out / "plots" / "tokens_per_s.png").is_file()


def test_bad_arguments_exit_2(model, capsys):
    assert bench_main(model + ["--methods", "ar,medusa"]) == 2
    assert "unknown method 'medusa'" in capsys.readouterr().err
    assert bench_main(model + ["--datasets", "squad"]) == 2
    assert bench_main(model + ["--gamma-sweep", "1"]) == 2


def test_first_mismatch_and_module_entry():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2
    import benchmarks.run
    import trtllm_moespec.bench

    assert benchmarks.run.main is trtllm_moespec.bench.main


def test_an_aborted_run_keeps_existing_reports(model, tmp_path, monkeypatch, capsys):
    """(case bench-abort-keeps-report) An aborted (or interrupted) run never replaces a finished report:
    its report goes to NAME.partial.EXT beside the kept files."""
    _lossy(monkeypatch, "evict")
    good_json, good_md = '{"status": "complete"}\n', "| finished table |\n"
    (tmp_path / "r.json").write_text(good_json)
    (tmp_path / "r.md").write_text(good_md)
    rc = cli_main(["bench"] + model + ["--methods", "ar,evict", "--datasets", "gsm8k", "--num-prompts", "1",
                                       "--max-tokens", "4", "--temperature", "0", "--json", str(tmp_path / "r.json"),
                                       "--markdown", str(tmp_path / "r.md")])
    assert rc == 3
    assert (tmp_path / "r.json").read_text() == good_json and (tmp_path / "r.md").read_text() == good_md
    assert json.loads((tmp_path / "r.partial.json").read_text())["status"] == "aborted"
    assert "aborted" in (tmp_path / "r.partial.md").read_text()
    assert "r.partial.json" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_output_paths_are_checked_before_the_run(model, tmp_path, capsys):
    """(case bench-output-is-directory) --json naming a directory, or --plots a file, fails at once."""
    (tmp_path / "plots.png").write_text("x")
    for flag, value, message in (("--json", tmp_path, "is a directory"), ("--markdown", tmp_path, "is a directory"),
                                 ("--plots", tmp_path / "plots.png", "is a file"),
                                 ("--json", tmp_path / "plots.png" / "r.json", "is not a directory")):
        assert bench_main(model + [flag, str(value)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and err.count("\n") == 0, err


def test_unwritable_output_folder_is_refused_before_the_run(model, capsys):
    """(case bench-output-unwritable) --json in a folder this process cannot create files in (sysfs refuses
    root too) fails at once, naming the flag, instead of after the whole measurement."""
    assert bench_main(model + ["--methods", "ar", "--json", "/sys/moespec/r.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--json /sys/moespec/r.json: cannot create files in /sys" in err and err.count("\n") == 0, err


def _small_run(model, out, *extra):
    return model + ["--methods", "ar,eagle3", "--datasets", "gsm8k", "--num-prompts", "2", "--max-tokens", "3",
                    "--temperature", "0", "--json", str(out / "r.json"), "--markdown", str(out / "r.md"), *extra]


def test_a_failed_final_write_keeps_the_report_elsewhere(model, tmp_path, monkeypatch, capsys, disk_full_in):
    """(case bench-final-write-fails) The disk fills up during the run: the report goes to the temporary
    directory, stderr says where, exit 1; nothing half-written is left beside the asked path."""
    import errno

    import trtllm_moespec.outfiles as outfiles

    disk_full_in(tmp_path)
    assert bench_main(_small_run(model, tmp_path)) == 1
    err = capsys.readouterr().err
    moved = re.search(r"cannot write --json \S+r\.json \(No space left on device\); the report went to (\S+)", err)
    assert moved, err
    report = json.loads(Path(moved[1]).read_text())
    assert report["status"] == "complete" and len(report["results"]) == 2
    markdown = re.search(r"cannot write --markdown \S+r\.md \(No space left on device\); the report went to (\S+)", err)
    assert markdown and "Table 1" in Path(markdown[1]).read_text(), err
    assert not list(tmp_path.iterdir())
    Path(moved[1]).unlink()
    Path(markdown[1]).unlink()

    def nowhere(path, text):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(outfiles, "write_text_atomic", nowhere)
    assert bench_main(_small_run(model, tmp_path)) == 1
    captured = capsys.readouterr()
    assert "the report follows on stdout" in captured.err
    assert '"schema": "moespec-bench/1"' in captured.out  # the whole report, on stdout


def test_sigterm_writes_a_partial_report(model, tmp_path, monkeypatch):
    """(case bench-sigterm) SIGTERM (timeout, CI, kill) mid-run is handled as Ctrl-C: a partial report,
    exit 143; the handler is given back after an in-process run."""
    import os
    import signal

    real, calls = MethodRunner.generate, []

    def generate(self, prompt_ids, params):
        calls.append(self.spec.label)
        if len(calls) == 2 + 4:  # warm-up (2 methods), the first prompt group (2), then SIGTERM in the second
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, prompt_ids, params)

    monkeypatch.setattr(MethodRunner, "generate", generate)
    before = signal.getsignal(signal.SIGTERM)
    assert bench_main(_small_run(model, tmp_path)) == 143
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["status"] == "interrupted" and report["error"].startswith("terminated (SIGTERM)")
    assert report["completed_prompt_groups"] == 1
    assert signal.getsignal(signal.SIGTERM) == before


def test_reports_get_the_usual_permissions(model, tmp_path):
    """(case report-umask) Reports are created as `open(path, "w")` creates files (0o666 less the umask),
    not 0600 as tempfile makes them; an existing report keeps its own mode."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        assert bench_main(_small_run(model, tmp_path)) == 0
        for name in ("r.json", "r.md"):
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name
        os.chmod(tmp_path / "r.json", 0o640)
        assert bench_main(_small_run(model, tmp_path)) == 0
        assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o640
    finally:
        os.umask(old)


def test_values_sweep_adds_one_column_per_cost_aware_method():
    from trtllm_moespec.bench import build_parser, resolve_methods

    args = build_parser().parse_args(["--methods", "eagle3,evict,joint", "--values", "calibrated",
                                      "--values-sweep", "raw,calibrated"])
    specs = {s.label: s for s in resolve_methods(args)}
    assert list(specs) == ["ar", "eagle3", "evict", "joint", "evict[values=raw]", "joint[values=raw]"]
    assert specs["evict"].values == "calibrated" and specs["joint[values=raw]"].values == "raw"
    assert cli_main(["bench", "--values", "bogus", "--num-prompts", "1"]) == 2


def test_repeats_keep_the_median_run_of_each_prompt_and_method(model, tmp_path, monkeypatch):
    """--repeats N runs every (prompt, method) N times, interleaved (every other round reversed), and reports the run of median
    time; the kept steps belong to one run (not a mix)."""
    from trtllm_moespec.bench import runner as bench_runner
    from trtllm_moespec.bench.methods import MethodRunner

    kept, order = [], []
    original = bench_runner.median_run
    monkeypatch.setattr(bench_runner, "median_run", lambda gens: kept.append(len(gens)) or original(gens))
    generate = MethodRunner.generate
    monkeypatch.setattr(MethodRunner, "generate", lambda self, *a: order.append(self.spec.label) or generate(self, *a))
    out = tmp_path / "r.json"
    assert bench_main(model + ["--methods", "ar,eagle3", "--datasets", "humaneval", "--num-prompts", "1",
                               "--max-tokens", "4", "--temperature", "0", "--repeats", "3", "--json", str(out)]) == 0
    assert kept == [3, 3]  # one choice per method, among three runs
    assert order[-6:] == ["ar", "eagle3", "eagle3", "ar", "ar", "eagle3"]  # every other round reversed
    report = json.loads(out.read_text())
    assert report["config"]["repeats"] == 3 and "--repeats 3" in report["command"]
    eagle = [r for r in report["results"] if r["method"] == "eagle3"][0]
    steps = [s for s in report["steps"] if s["method"] == "eagle3"][0]
    assert len(steps["step_ms"]) == eagle["num_steps"]
    assert bench_main(model + ["--repeats", "0"]) == 2


def test_median_run_picks_the_middle_time():
    from trtllm_moespec.bench.methods import Generation
    from trtllm_moespec.bench.runner import median_run
    from trtllm_moespec.engine.stats import GenerationStats, StepStats

    def gen(ms: float) -> Generation:
        steps = [StepStats(verified_tokens=0, accepted_tokens=0, committed_tokens=1, unique_experts_per_layer=4.0,
                           draft_ms=0.0, predictor_ms=0.0, select_ms=0.0, verify_ms=ms, target_ms=ms, commit_ms=0.0,
                           step_ms=ms)]
        return Generation([1], GenerationStats.from_steps(steps, 1, prefill_ms=1.0), steps)

    runs = [gen(5.0), gen(1.0), gen(3.0)]
    assert median_run(runs) is runs[2]
    assert median_run(runs[:2]) is runs[1]  # even count: the faster of the two middle runs
