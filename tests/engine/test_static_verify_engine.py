"""The engine with bucketed static-shape verify forwards (`TargetModel.use_verify_runner("static")`:
the function `VerifyGraphs` captures on CUDA, run eagerly) decodes exactly what plain decoding does,
for ar, eagle3 and joint, on Qwen3-MoE and GPT-OSS; and the `cuda_graphs` option's checks. Requests
run one at a time (`max_batch_size=1`): the per-request step is the one these runners serve."""

from __future__ import annotations

import pytest

from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.models.cuda_graphs import verify_buckets

PROMPTS = [[5, 17, 33, 2, 9, 100, 4], [1, 2, 3, 1, 2, 3, 1, 2]]
MAX_TOKENS = 20  # > 2 * the GPT-OSS test window (8)


def _llm(checkpoints, arch, policy, **kwargs):
    target, draft = checkpoints[arch]
    predictor = "oracle" if policy == "joint" else None
    # guard off: every step speculates, so the static verify runs trees (the guard would rightly decode
    # these random drafters' trees plainly)
    return LLM(str(target), draft_model=str(draft), policy=policy, predictor=predictor, guard="off", **kwargs)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_static_verify_engine_equals_plain_decoding(checkpoints, arch):
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = [o.token_ids for o in _llm(checkpoints, arch, "ar").generate(PROMPTS, params, max_batch_size=1)]
    for policy in ("ar", "eagle3", "joint"):
        llm = _llm(checkpoints, arch, policy)
        assert llm.cuda_graphs is False and llm.target.verify_runner is None  # CPU default: eager
        llm.target.use_verify_runner("static", verify_buckets(llm.tree.max_draft_tokens))
        outs = llm.generate(PROMPTS, params, max_batch_size=1)
        assert [o.token_ids for o in outs] == plain, f"{policy} with the static verify diverged"
        assert llm.target._runners, "the static path was never used"
        if policy != "ar":
            assert sum(o.stats.verified_tokens for o in outs) > 0


def test_cuda_graphs_option_is_checked_before_loading(checkpoints):
    target, _ = checkpoints["qwen3_moe"]
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        LLM(str(target), policy="ar", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        LLM(str(target), policy="ar", cuda_graphs="yes")
    assert LLM(str(target), policy="ar", cuda_graphs=False).cuda_graphs is False


def test_device_selection_cuts_the_selection_to_its_verify_bucket(checkpoints):
    """The CUDA step's one read-back: the selected count picks the bucket; the selection is cut or
    -1 padded to it (called here on CPU tensors: the method itself has no device-specific code)."""
    import torch

    from trtllm_moespec.core.tree import DraftTree

    llm = _llm(checkpoints, "qwen3_moe", "eagle3")
    parents = torch.tensor([[-1, 0, 1, -1, 3, 4, 5, 0, 7, 8]])
    tree = DraftTree.from_parents(torch.arange(10)[None], parents, torch.full((1, 10), 0.5))
    node_idx = torch.tensor([[0, 1, 2, 3, 4, -1, -1, -1]])  # 5 selected, depths 1 2 3 1 2
    llm.target.use_verify_runner("static", (1, 2, 4, 8, 16))
    cut, depth = llm.engine._device_selection(tree, node_idx)
    assert depth == 3 and cut.tolist() == [[0, 1, 2, 3, 4, -1, -1]]  # 1 + 5 positions -> bucket 8
    llm.target.use_verify_runner("static", (1, 16))
    cut, _ = llm.engine._device_selection(tree, node_idx)
    assert cut.shape == (1, 15) and cut[0, :5].tolist() == [0, 1, 2, 3, 4] and bool((cut[0, 5:] == -1).all())
    llm.target.use_verify_runner(None)
    cut, depth = llm.engine._device_selection(tree, node_idx)
    assert cut.tolist() == [[0, 1, 2, 3, 4]] and depth == 3


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("policy", ["eagle3", "joint"])
def test_static_drafter_forwards_keep_greedy_output(checkpoints, arch, policy):
    """The drafter's per-step extension and its tree-drafting forwards through the static-shape
    drafter forward (what `DrafterGraphs` / `DrafterFrontierGraphs` capture), together with the
    static verify: greedy output unchanged."""
    from trtllm_moespec.models.eagle3.graphs import StaticDrafterExtend, StaticDrafterFrontier

    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = [o.token_ids for o in _llm(checkpoints, arch, "ar").generate(PROMPTS, params, max_batch_size=1)]
    llm = _llm(checkpoints, arch, policy)
    llm.target.use_verify_runner("static", verify_buckets(llm.tree.max_draft_tokens))
    source = llm.engine.draft_source
    source.extend_runner = StaticDrafterExtend(source.drafter, verify_buckets(llm.tree.steps))
    source.frontier_runner = StaticDrafterFrontier(source.drafter, llm.tree.topk)
    calls, frontiers = [], []
    run, run_frontier = source.extend_runner.run, source.frontier_runner.run
    source.extend_runner.run = lambda *a: calls.append(a[2].shape[1]) or run(*a)  # count real uses
    source.frontier_runner.run = lambda *a: frontiers.append(a[2].shape[1]) or run_frontier(*a)
    outs = llm.generate(PROMPTS, params, max_batch_size=1)
    assert [o.token_ids for o in outs] == plain
    assert calls and max(calls) <= llm.tree.steps + 1
    assert frontiers and max(frontiers) <= llm.tree.topk, "the tree-drafting forwards never used the runner"
    # one request at a time: each drafted on the buffer (and, on CUDA, the graphs) of the one before
    assert source.drafter.kv_pool.allocated == 1
    eager = _llm(checkpoints, arch, policy).generate(PROMPTS, params, max_batch_size=1)
    # the drafter state matches too: every step accepted as many tokens as with the eager drafter
    assert [o.stats.acceptance_lengths for o in outs] == [o.stats.acceptance_lengths for o in eager]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_sync_free_drafting_keeps_greedy_output(checkpoints, arch):
    """The CUDA drafting loop (`Eagle3Source.sync_free`, on by default off the CPU) run on CPU tensors:
    every drafting forward takes the whole padded frontier (no read of how many entries are real),
    through the static frontier runner and through the eager forward, one request at a time and
    batched: greedy output and acceptance lengths unchanged."""
    from trtllm_moespec.models.eagle3.graphs import StaticDrafterFrontier

    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = [o.token_ids for o in _llm(checkpoints, arch, "ar").generate(PROMPTS, params, max_batch_size=1)]
    host = _llm(checkpoints, arch, "eagle3").generate(PROMPTS, params, max_batch_size=1)
    for runner, batch in ((True, 1), (False, 1), (False, 2)):
        llm = _llm(checkpoints, arch, "eagle3")
        source = llm.engine.draft_source
        source.sync_free = True
        rows = []
        if runner:
            source.frontier_runner = StaticDrafterFrontier(source.drafter, llm.tree.topk)
            run = source.frontier_runner.run
            source.frontier_runner.run = lambda *a: rows.append(a[2].shape[1]) or run(*a)
        outs = llm.generate(PROMPTS, params, max_batch_size=batch)
        assert [o.token_ids for o in outs] == plain
        assert [o.stats.acceptance_lengths for o in outs] == [o.stats.acceptance_lengths for o in host]
        assert not runner or (rows and set(rows) == {llm.tree.topk})  # always the whole frontier


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_drafter_graph_runners_replay_across_requests(checkpoints, arch):
    """The drafter's graph runners as the engine drives them, with capture replaced by the stand-in
    that replays by recomputing into the captured outputs (`tests/models/graph_stand_in.py`): greedy
    output unchanged; the requests, served one after another, reuse one drafter buffer, so the
    tree-drafting graph is captured once for all of them and each extension bucket at most once."""
    from tests.models.graph_stand_in import RecomputeCapture
    from trtllm_moespec.models.eagle3.graphs import DrafterFrontierGraphs, DrafterGraphs, DrafterGraphStore

    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = [o.token_ids for o in _llm(checkpoints, arch, "ar").generate(PROMPTS, params, max_batch_size=1)]
    llm = _llm(checkpoints, arch, "eagle3")
    source, drafter = llm.engine.draft_source, llm.engine.draft_source.drafter
    capture = RecomputeCapture()
    source.extend_runner = DrafterGraphs(drafter, verify_buckets(llm.tree.steps),
                                         graphs=DrafterGraphStore(drafter, None, capture=capture))
    source.frontier_runner = DrafterFrontierGraphs(drafter, llm.tree.topk,
                                                   graphs=DrafterGraphStore(drafter, None, capture=capture))
    assert [o.token_ids for o in llm.generate(PROMPTS * 2, params, max_batch_size=1)] == plain * 2
    assert drafter.kv_pool.allocated == 1
    assert source.frontier_runner.captures == 1 and source.frontier_runner.replays > 0
    assert 1 <= source.extend_runner.captures <= len(source.extend_runner.buckets)


def test_failed_drafter_graph_capture_falls_back_to_eager(checkpoints):
    """A drafter graph that cannot be captured (here: a runner raising GraphCaptureError, as
    capture does on a kernel it cannot record) warns, is dropped, and the step drafts and extends
    eagerly: greedy output unchanged."""
    from trtllm_moespec.models.cuda_graphs import GraphCaptureError
    from trtllm_moespec.models.eagle3.graphs import StaticDrafterExtend, StaticDrafterFrontier

    class Failing:
        def __init__(self, runner):
            self.runner, self.calls = runner, 0

        def __getattr__(self, name):
            return getattr(self.runner, name)

        def run(self, *args):
            self.calls += 1
            raise GraphCaptureError("cannot capture")

    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = [o.token_ids for o in _llm(checkpoints, "qwen3_moe", "ar").generate(PROMPTS, params, max_batch_size=1)]
    llm = _llm(checkpoints, "qwen3_moe", "eagle3")
    source = llm.engine.draft_source
    extend = Failing(StaticDrafterExtend(source.drafter, verify_buckets(llm.tree.steps)))
    frontier = Failing(StaticDrafterFrontier(source.drafter, llm.tree.topk))
    source.extend_runner, source.frontier_runner = extend, frontier
    with pytest.warns(RuntimeWarning) as record:
        outs = llm.generate(PROMPTS, params, max_batch_size=1)
    messages = [str(w.message) for w in record]
    assert sum("tree-drafting forward failed" in m for m in messages) == 1
    assert sum("extension forward failed" in m for m in messages) == 1
    assert [o.token_ids for o in outs] == plain
    assert frontier.calls == 1 and extend.calls == 1  # tried once each, then eager for good
    assert source.frontier_runner is None and source.extend_runner is None


def test_cli_cuda_graphs_flag():
    import argparse

    from trtllm_moespec.cli import _add_model_args

    p = argparse.ArgumentParser()
    _add_model_args(p)
    assert p.parse_args([]).cuda_graphs is None
    assert p.parse_args(["--cuda-graphs"]).cuda_graphs is True
    assert p.parse_args(["--no-cuda-graphs"]).cuda_graphs is False
