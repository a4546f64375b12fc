"""`moespec profile` on a tiny random Qwen3-MoE + EAGLE-3 drafter: real engine steps, few repeats."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.engine.conftest import make_checkpoint
from trtllm_moespec.cli import main as cli_main
from trtllm_moespec.core.cost import CostTable
from trtllm_moespec.engine.config import TreeConfig
from trtllm_moespec.profiling import profile_model
from trtllm_moespec.profiling.measure import CostCurve, StepSample, assess_noise, monotone, trim_outliers, trim_values

TREE = TreeConfig(2, 4, 8)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """Profile written beside the model by the CLI (overwrites the synthetic (4, 8, 32) one)."""
    target, draft = make_checkpoint(tmp_path_factory.mktemp("profile"), "qwen3_moe")
    rc = cli_main(["profile", "--model", str(target), "--draft-model", str(draft), "--tree", "2,4,8",
                   "--repeats", "3", "--warmup", "1", "--prompts", "def add(a, b):", "Janet has 16 eggs.",
                   "--allow-noisy"])  # 3 repeats on a random model: too few to rank, written anyway (labelled)
    assert rc == 0
    return target, draft, target / "cost_profile.json"


def test_profile_is_valid_and_loadable(profiled):
    target, _, path = profiled
    data = json.loads(path.read_text())
    table = CostTable.load(path, model_id=target.name, device="cpu", dtype="float32", tree=TREE.as_tuple())
    assert len(table.costs) == TREE.max_draft_tokens + 1
    assert all(b >= a for a, b in zip(table.costs, table.costs[1:]))  # non-decreasing fit
    assert table.spread is not None and len(table.spread) == len(table.costs)
    assert table.expert_model is not None and 2 * 9 <= table.expert_model.num_samples <= 3 * 9
    assert data["measured"]["count"] == [3] * (TREE.max_draft_tokens + 1)  # every k measured, none skipped
    assert "interleaved" in table.method and table.date


def test_samples_verify_exactly_k_and_count_root_experts(profiled):
    _, _, path = profiled
    s = json.loads(path.read_text())["measured"]["samples"]
    # 3 MoE layers x top-2: the root alone wakes exactly 6 (layer, expert) pairs; more nodes never fewer.
    u0 = [u for k, u in zip(s["k"], s["unique_experts"]) if k == 0]
    assert u0 == [6, 6, 6]
    assert all(u >= 6 for u in s["unique_experts"]) and max(s["unique_experts"]) <= 3 * 8
    assert sorted(set(s["k"])) == list(range(TREE.max_draft_tokens + 1))


def test_policies_pick_up_the_profile(profiled):
    from trtllm_moespec import LLM

    target, draft, path = profiled
    table = CostTable.load(path)
    evict = LLM(model=str(target), draft_model=str(draft), policy="evict", tree=TREE)
    assert evict.policy.cost_table.costs == table.costs
    joint = LLM(model=str(target), draft_model=str(draft), policy="joint", tree=TREE, predictor="oracle")
    assert joint.policy.cost_model == table.expert_model


def test_without_a_tree_the_model_drafts_the_tree_its_profile_was_measured_with(profiled, tmp_path):
    from trtllm_moespec import LLM

    target, draft, path = profiled
    assert TREE != TreeConfig()  # (2, 4, 8): not the 4,8,32 fallback, so the assertions below can fail
    evict = LLM(model=str(target), draft_model=str(draft), policy="evict")
    assert evict.tree == TREE and evict.engine.draft_source.steps == TREE.steps
    assert evict.engine.draft_source.topk == TREE.topk and evict.engine.tree == TREE
    eagle3 = LLM(model=str(target), draft_model=str(draft), policy="eagle3")  # no profile needed, still the model's
    assert eagle3.tree == TREE
    # a profile given explicitly names the tree; a roofline estimate names none (EAGLE's 4,8,32)
    other = tmp_path / "other_profile.json"
    other.write_text(json.dumps({**json.loads(path.read_text()), "tree": [3, 4, 8]}))
    assert LLM(model=str(target), draft_model=str(draft), policy="eagle3", cost_profile=str(other)).tree == \
        TreeConfig(3, 4, 8)
    assert LLM(model=str(target), draft_model=str(draft), policy="eagle3", cost_profile="roofline:H200").tree == \
        TreeConfig()


def test_profile_for_another_setting_is_refused(profiled):
    from trtllm_moespec import LLM

    target, draft, path = profiled
    with pytest.raises(ValueError, match=r"tree \(2, 4, 8\) \(expected \(4, 8, 32\)\)"):
        LLM(model=str(target), draft_model=str(draft), policy="evict", tree=TreeConfig(4, 8, 32))
    with pytest.raises(ValueError, match="model 'qwen3_moe' \\(expected 'other-model'\\)"):
        CostTable.load(path, model_id="other-model")
    with pytest.raises(ValueError, match="device 'cpu' \\(expected 'cuda:NVIDIA H200'\\)"):
        CostTable.load(path, device="cuda:NVIDIA H200")
    with pytest.raises(ValueError, match="dtype"):
        CostTable.load(path, dtype="bfloat16")


def test_profile_to_out_path_and_bad_repeats(profiled, tmp_path):
    target, draft, _ = profiled
    with pytest.raises(ValueError, match="repeats"):
        profile_model(str(target), str(draft), TREE, repeats=1, out=tmp_path / "x.json", show_progress=False)
    assert not (tmp_path / "x.json").exists()


def test_monotone_pool_adjacent_violators():
    assert monotone((1.0, 3.0, 2.0, 4.0)) == (1.0, 2.5, 2.5, 4.0)
    assert monotone((5.0, 1.0, 1.0)) == pytest.approx((7 / 3,) * 3)
    assert monotone((1.0, 2.0)) == (1.0, 2.0)


def test_trim_outliers_drops_load_spikes_per_k():
    steps = [StepSample(k, k, 4, t, t) for k, ts in ((0, (1.0, 1.1, 0.9, 1.0, 9.0)), (1, (2.0, 2.0, 2.0)))
             for t in ts]
    kept = trim_outliers(steps)
    assert sorted(s.seconds for s in kept) == [0.9, 1.0, 1.0, 1.1, 2.0, 2.0, 2.0]


def test_plain_step_drafter_forward_and_load_are_recorded(profiled):
    _, _, path = profiled
    data = json.loads(path.read_text())
    table = CostTable.load(path)
    assert table.plain_step > 0 and table.draft_forward > 0  # measured (their sizes are timings: not asserted)
    assert len(table.load_average) == 6
    # span C(K) - C(0) of the monotone fit: flat (0) when a loaded machine hides the tiny model's span,
    # which the verdict then calls unusable (seen once with both test workers busy)
    noise = data["noise"]
    assert noise["verdict"] in ("ok", "noisy", "unusable") and (noise["span_s"] > 0 or noise["verdict"] == "unusable")
    assert -1 not in data["measured"]["samples"]["k"]  # plain steps are not C(k) samples


def test_out_directory_is_refused_early_and_leaves_nothing(profiled, tmp_path, capsys):
    target, draft, _ = profiled
    (tmp_path / "d").mkdir()
    rc = cli_main(["profile", "--model", str(target), "--draft-model", str(draft), "--tree", "2,4,8",
                   "--repeats", "3", "--out", str(tmp_path / "d")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a directory" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no stray .tmp


def test_default_out_never_writes_the_shipped_assets(tmp_path, monkeypatch):
    from trtllm_moespec.assets import TINY_DIR
    from trtllm_moespec.profiling import output_path

    monkeypatch.chdir(tmp_path)
    shipped = TINY_DIR / "cost_profile.json"
    assert output_path(shipped, None) == tmp_path / "moespec-tiny.cost_profile.json"
    assert output_path(tmp_path / "m" / "cost_profile.json", None) == tmp_path / "m" / "cost_profile.json"
    assert output_path(shipped, shipped) == shipped  # explicit --out: the maintainer's regeneration


def test_noise_check_refuses_what_it_cannot_rank():
    def curve(iqr, n):
        return CostCurve((0.040, 0.050), (iqr, iqr), (1.0, 2.0), (n, n))

    costs = (0.040, 0.050)  # C(K) - C(0) = 10 ms
    assert assess_noise(curve(0.002, 40), costs, 0.015).verdict == "ok"  # SE 0.29 ms
    assert assess_noise(curve(0.012, 20), costs, 0.015).verdict == "noisy"  # SE 2.5 ms
    bad = assess_noise(curve(0.030, 10), costs, 0.015)  # SE 8.8 ms
    assert bad.verdict == "unusable" and "ratio" in bad.message()
    # The k = 0 rule ranks C(0) against the plain step: a 1 ms gap is the smaller difference there.
    assert assess_noise(curve(0.002, 40), costs, 0.039).verdict == "unusable"


def test_trim_values_drops_spikes_on_both_sides():
    assert trim_values([1.0, 1.1, 0.9, 1.0, 9.0, -5.0]) == [1.0, 1.1, 0.9, 1.0]
    assert trim_values([1.0, 50.0]) == [1.0, 50.0]  # too few to call anything an outlier


def test_profile_file_mode_and_a_failed_final_write(profiled, tmp_path, capsys, disk_full_in):
    """(case report-umask) The profile is created with the usual mode (0o666 less the umask), not 0600;
    (case profile-final-write-fails) a final write that fails (full disk) puts the profile in the
    temporary directory, says where, and exits 1."""
    import os
    import re
    import stat
    from pathlib import Path

    target, draft, path = profiled
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    disk_full_in(tmp_path)
    rc = cli_main(["profile", "--model", str(target), "--draft-model", str(draft), "--tree", "2,4,8", "--repeats", "3",
                   "--warmup", "1", "--prompts", "def add(a, b):", "--allow-noisy", "--out", str(tmp_path / "p.json")])
    assert rc == 1
    captured = capsys.readouterr()
    moved = re.search(r"cannot write --out \S+p\.json \(No space left on device\); the report went to (\S+)", captured.err)
    assert moved, captured.err
    assert CostTable.load(moved[1], override=True).tree == (2, 4, 8) and f"wrote {moved[1]}" in captured.out
    assert not list(tmp_path.iterdir())
    Path(moved[1]).unlink()


def test_expert_overhead_is_measured_where_joint_has_a_predictor(profiled):
    """What joint's expert term costs a step is timed side by side with evict on the real engines; a model
    without an expert predictor has nothing to decide (None), and its profile says so."""
    from trtllm_moespec import LLM
    from trtllm_moespec.core.cost import expert_term_pays
    from trtllm_moespec.profiling import measure_expert_overhead

    target, draft, path = profiled
    assert CostTable.load(path).expert_overhead is None  # the random checkpoint ships no predictor
    tiny = LLM("moespec-tiny", policy="eagle3")
    table = CostTable.load(tiny.paths.cost_profile)
    overhead = measure_expert_overhead(tiny, table, [[5, 17, 33, 2, 9, 100, 4]], tokens=16)
    assert overhead is not None and 0 < overhead < 0.1  # seconds: the predictor runs and is timed
    with_it = replace(table, expert_overhead=overhead,
                      expert_model=replace(table.expert_model, c_exp_within=0.0, unique_spread=10.0))
    assert expert_term_pays(with_it)[0] is False  # a term that saves nothing never pays for a predictor
