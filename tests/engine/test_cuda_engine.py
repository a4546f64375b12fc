"""CUDA checks of the lean engine (skipped without CUDA; `benchmarks/gpu_check.sh` runs them):
greedy output on moespec-tiny equals transformers `generate` on the same GPU with CUDA graphs on
and off, graphs-on output equals graphs-off output, and a verify replayed from its bucket's CUDA
graph equals the eager verify forward, and a tree drafted through the drafter's frontier graph
equals the eagerly drafted tree; logit rules (on the device) stay lossless. NEVER RUN YET: this project has had
no GPU machine."""

from __future__ import annotations

import pytest
import torch

from trtllm_moespec import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def reference():
    llm = LLM("moespec-tiny", policy="ar", device="cuda", model_impl="hf")
    ids = llm.encode([PROMPT])[0]
    out = llm.target.model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=32, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
    return ids, out[0, len(ids):].tolist()


@pytest.mark.parametrize("policy", ["ar", "eagle3", "joint"])
@pytest.mark.parametrize("model_impl,cuda_graphs", [("lean", True), ("lean", False), ("hf", False)])
def test_cuda_greedy_equals_transformers_generate(reference, policy, model_impl, cuda_graphs):
    ids, want = reference
    llm = LLM("moespec-tiny", policy=policy, device="cuda", model_impl=model_impl, override_profile=True,
              cuda_graphs=cuda_graphs)
    assert llm.target.verify_runner == ("graphs" if cuda_graphs else None)
    out = llm.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert out.token_ids == want
    if cuda_graphs:
        assert llm.target.verify_runner == "graphs", "capture failed and the target fell back to eager"
        assert sum(r.captures for r in llm.target._runners.values()) >= 1
        if policy != "ar":  # the drafter's per-step extension and its tree-drafting steps replay their own graphs
            source = llm.engine.draft_source
            assert source.extend_runner is not None and source.extend_runner.captures >= 1
            assert source.frontier_runner is not None, "tree-drafting capture failed and fell back to eager"
            assert source.frontier_runner.captures >= 1 and source.frontier_runner.replays > 0


@pytest.mark.parametrize("policy,values", [("evict", "head"), ("joint", "head"), ("joint", "calibrated")])
def test_cuda_node_value_models_keep_greedy_output(reference, policy, values):
    """The cost-aware policies rank on node values computed from the drafted tree on the device
    (the acceptance head runs where the drafter's features are): greedy output unchanged."""
    ids, want = reference
    llm = LLM("moespec-tiny", policy=policy, values=values, guard="off", device="cuda", override_profile=True)
    out = llm.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert out.token_ids == want
    assert out.stats.verified_tokens > 0


def test_cuda_eagle3_step_reads_the_host_once_before_the_verify():
    """The README's claim: with graphs on, an eagle3 step synchronises with the device once before the
    verify (the selected count and depth pick the bucket): drafting, selection and layout read nothing."""
    from benchmarks.gpu_check import host_syncs

    row = host_syncs(torch.device("cuda"), tokens=16, policies=("eagle3",))[0]
    assert row["steps"] > 0 and row["max"] <= 1, f"syncs per step up to {row['max']}, at {row['places']}"


def test_host_values_reach_the_device_without_a_sync():
    from trtllm_moespec.core.device import host_tensor, token_tensor

    device = torch.device("cuda")
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
    try:
        values, token = host_tensor([3, 1, 4], device), token_tensor(7, device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert values.device.type == "cuda" and values.tolist() == [3, 1, 4] and token.tolist() == [7]


def test_cuda_logit_rules_and_bias_are_lossless():
    """Penalties and a logit bias on CUDA (the history lives on the device): eagle3's
    greedy output under them equals plain decoding's, and the bias's banned token never appears."""
    params = dict(max_tokens=48, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.4)
    outs = {}
    for policy in ("ar", "eagle3"):
        llm = LLM("moespec-tiny", policy=policy, device="cuda", override_profile=True)
        ids = llm.encode([PROMPT])[0]
        banned = llm.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids[1]
        out = llm.generate([ids], SamplingParams(**params, logit_bias={banned: -100.0}))[0]
        assert banned not in out.token_ids
        outs[policy] = out.token_ids
    assert outs["eagle3"] == outs["ar"]


@pytest.mark.parametrize("policy", ["ar", "eagle3", "joint"])
def test_cuda_graphs_on_equals_graphs_off(policy):
    """A longer generation (past the first cache growth is not needed: 4096 slots) on two prompts."""
    outs = {}
    for graphs in (True, False):
        llm = LLM("moespec-tiny", policy=policy, device="cuda", override_profile=True, cuda_graphs=graphs)
        prompts = llm.encode([PROMPT, "The quick brown fox"])
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=96, ignore_eos=True))]
        if graphs and policy == "eagle3":  # the second request reused the first one's drafter buffer and graphs
            source = llm.engine.draft_source
            assert source.drafter.kv_pool.allocated == 1
            assert source.frontier_runner.captures == 1
            assert source.extend_runner.captures <= len(source.extend_runner.buckets)
    assert outs[True] == outs[False]


def test_graph_capture_recaptures_after_the_cache_grows():
    """Growing the static cache moves the tensors the graphs point at: they are recaptured and stay exact."""
    llm = LLM("moespec-tiny", policy="ar", device="cuda", override_profile=True)
    target = llm.target
    ids = llm.encode([PROMPT])[0]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    before = llm.generate([ids], params)[0].token_ids
    target._pool.ensure_len(2 * target._pool.max_len)  # what a long request does
    assert llm.generate([ids], params)[0].token_ids == before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_graph_replay_equals_eager_verify(dtype):
    """float32 (torch's grouped GEMM reads its group offsets on the host there, so a verify's experts run
    as the gathered matmul, models/moe.py): the replay against the eager verify forward. bfloat16 (torch's
    device-only grouped GEMM on sm90/sm100): against the very bucketed call the graph captured, run
    eagerly (`StaticVerify`), since bf16 rounding differs between the eager forward's attention and the
    static one's."""
    from trtllm_moespec.core.layout import build_layout
    from trtllm_moespec.core.tree import DraftTree
    from trtllm_moespec.models.cuda_graphs import StaticVerify, VerifyGraphs

    llm = LLM("moespec-tiny", policy="ar", device="cuda", dtype=dtype, cuda_graphs=False)  # target.verify is eager
    target = llm.target
    cache = target.new_cache()
    gen = torch.Generator().manual_seed(0)
    target.prefill(cache, torch.randint(0, target.vocab_size, (1, 40), generator=gen))
    graphs = VerifyGraphs(target.lean, target._pool, cache.slot, buckets=(1, 4, 8))
    static = StaticVerify(target.lean, target._pool, cache.slot, buckets=(1, 4, 8))
    for k in (0, 2, 5):
        tree = DraftTree.from_parents(torch.randint(0, target.vocab_size, (1, k), generator=gen),
                                      torch.tensor([[i - 1 for i in range(k)]]), torch.full((1, k), 0.5))
        layout = build_layout(tree, torch.arange(k)[None], torch.tensor([3]))
        inputs = (layout.token_ids.cuda(), layout.position_ids(40).cuda(), torch.tensor([40], device="cuda"),
                  layout.tree_mask().cuda())
        if dtype == "float32":
            want = target.verify(cache, layout)
            target.discard(cache)
            atol = 1e-4
        else:
            want = static.run(*inputs)
            atol = 5e-2
        got = graphs.run(*inputs)
        torch.testing.assert_close(got.logits, want.logits, atol=atol, rtol=0)
        assert torch.equal(got.expert_ids, want.expert_ids)
    assert graphs.captures == 3


def test_frontier_graph_drafts_the_eager_tree():
    """`DrafterFrontierGraphs`: one graph captured for the topk-wide frontier, replayed for every
    drafting step, drafts the tree `Eagle3Drafter.forward` drafts; a second request reuses the first
    one's buffer (`DrafterKVPool`) and so its graph; two live requests get a graph each."""
    from trtllm_moespec.models.eagle3.drafting import draft_eagle3_tree
    from trtllm_moespec.models.eagle3.graphs import DrafterFrontierGraphs

    llm = LLM("moespec-tiny", policy="eagle3", device="cuda", cuda_graphs=False)
    source = llm.engine.draft_source
    assert source.frontier_runner is None  # graphs off: the default path
    drafter, steps, topk = source.drafter, llm.tree.steps, llm.tree.topk
    graphs = DrafterFrontierGraphs(drafter, topk)
    gen = torch.Generator().manual_seed(0)
    for request in range(2):
        cache = drafter.new_cache()
        n = 30 + 7 * request
        drafter.extend(cache, torch.randint(0, 100, (1, n), generator=gen).cuda(),
                       torch.randn(1, n, drafter.fc.in_features, generator=gen).cuda().to(drafter.fc.weight.dtype))
        eager = draft_eagle3_tree(drafter, cache, steps, topk)
        got = draft_eagle3_tree(drafter, cache, steps, topk, frontier_runner=graphs)
        assert torch.equal(got.tree.token_ids, eager.tree.token_ids)
        assert torch.equal(got.tree.parents, eager.tree.parents)
        torch.testing.assert_close(got.tree.scores, eager.tree.scores, atol=1e-4, rtol=0)
        assert graphs.captures == 1  # one graph per buffer, not one per step or per request
    assert graphs.replays == 2 * eager.num_forwards
    other = drafter.new_cache()  # live beside `cache`: its own buffer, its own graph
    drafter.extend(other, torch.randint(0, 100, (1, 12), generator=gen).cuda(),
                   torch.randn(1, 12, drafter.fc.in_features, generator=gen).cuda().to(drafter.fc.weight.dtype))
    for c in (other, cache, other):
        eager = draft_eagle3_tree(drafter, c, steps, topk)
        got = draft_eagle3_tree(drafter, c, steps, topk, frontier_runner=graphs)
        assert torch.equal(got.tree.token_ids, eager.tree.token_ids)
    assert graphs.captures == 2 and graphs.graphs.num_buffers == 2
