"""The selection reaches TensorRT-LLM's verify: copies fill the captured length, wake no new experts
and are never committed (F2 of issue 26).

The worker's output goes through a Python model of TensorRT-LLM's tree builder and greedy verify
(tests/backends/trtllm_tree_model.py, from dynamicTreeKernels.cu @ 84e55f930cbab36e096af441a2e07abdb4199db4)
on history buffers filled as its draft loop fills them (test_buffers.fill_history).
"""

import random

import pytest
import torch

from tests.backends.test_buffers import fill_history, random_draft
from tests.backends.trtllm_tree_model import build_dynamic_tree, children, greedy_accept, path_experts, paths
from trtllm_moespec.backends.trtllm.buffers import DynamicTreeHistory, draft_tree_from_history
from trtllm_moespec.backends.trtllm.padding import pad_with_copies
from trtllm_moespec.backends.trtllm.selection import WorkerSettings
from trtllm_moespec.backends.trtllm.worker import make_worker_class
from trtllm_moespec.core.cost import CostTable

B, K, D, N = 4, 8, 4, 32


class _Worker:
    """TensorRT-LLM's dynamic-tree worker reduced to the buffers the override reads and writes."""

    def __init__(self, history: DynamicTreeHistory, verify_length: int):
        self.K, self.max_draft_len, self.max_total_draft_tokens = history.topk, history.max_draft_len, verify_length
        self.history_draft_tokens_buffer = history.draft_tokens.clone()
        self.history_score_buffer = history.scores.clone()
        self.history_draft_tokens_parent_buffer = history.parents.clone()


def _history_paths(history: DynamicTreeHistory) -> list[dict[int, tuple[int, ...]]]:
    tree = draft_tree_from_history(history)
    out = []
    for b in range(history.scores.shape[0]):
        p: dict[int, tuple[int, ...]] = {}
        for h in range(tree.num_nodes):
            parent = int(tree.parents[b, h])
            p[h] = (p[parent] if parent >= 0 else ()) + (int(tree.token_ids[b, h]),)
        out.append(p)
    return out


def peaked_draft(batch, seed, vocab=1000):
    """Draft probabilities as a trained drafter gives them (one clear favourite per node), so that the
    policy's selections go deeper than the root's children."""
    root_ids, _, step_ids, _ = random_draft(batch, K, D, seed=seed, vocab=vocab)
    g = torch.Generator().manual_seed(seed + 1)

    def probs(*shape):
        p = torch.softmax(torch.randn(*shape, K, generator=g) * 2.5, -1) * 0.95
        return p.sort(-1, descending=True).values

    return root_ids, probs(batch), step_ids, [probs(batch, K) for _ in range(D - 1)]


@pytest.fixture
def evict_worker(tmp_path):
    table = CostTable(costs=tuple(0.010 + 0.0004 * k + 0.00002 * k * k for k in range(N + 1)), model_id="m")
    settings = WorkerSettings(policy="evict", cost_profile=str(table.save(tmp_path / "cost_profile.json")))
    history = fill_history(*peaked_draft(B, seed=21))
    return make_worker_class(_Worker)(history, N, moespec_settings=settings), history


def test_padded_verify_is_the_selection_and_never_commits_a_copy(evict_worker):
    worker, history = evict_worker
    from trtllm_moespec.core.policies import make_policy

    selection = make_policy("evict", cost_table=CostTable.load(worker.moespec_settings.cost_profile),
                            budget=N).select(draft_tree_from_history(history))
    assert 0 < int(selection.num_selected.min()) and int(selection.num_selected.max()) < N  # padding is needed
    tokens, indices = worker.resampling_final_draft_tokens(B)
    assert tokens.shape == indices.shape == (B, N) and (indices.diff(dim=1) > 0).all()
    history_paths = _history_paths(history)
    rng = random.Random(0)
    for b in range(B):
        built = build_dynamic_tree(worker.history_draft_tokens_parent_buffer[b].tolist(), indices[b].tolist(),
                                   tokens[b].tolist(), K)  # raises if a parent is missing
        chosen = selection.node_idx[b][selection.node_idx[b] >= 0].tolist()
        want = {history_paths[b][h] for h in chosen}
        verified = paths(built)
        # Every verified node is a node of the selection (same token path, hence the same hidden state).
        assert set(verified[1:]) == want
        experts = set().union(*(path_experts(p) for p in verified))
        assert experts == set().union(path_experts(()), *(path_experts(p) for p in want))
        copies = {i for i in range(1, N + 1)
                  if any(built.tokens[s] == built.tokens[i] for s in children(built, built.parent[i]) if s < i)}
        assert len(copies) == N - len(chosen)
        # Whatever the target predicts (each node's token included), no copy is ever accepted.
        for trial in range(200):
            target = {p: rng.choice([built.tokens[c] for c in range(1, N + 1)] + [-5]) for p in range(N + 1)}
            for pos in range(N + 1):  # one trial per position where the target follows the tree exactly
                if trial == pos:
                    for c in children(built, pos):
                        target[pos] = built.tokens[c]
            assert not copies & set(greedy_accept(built, target, D))


def test_plain_step_choice_is_extended_by_the_fewest_nodes():
    """k = 0 (evict chose a plain step): TensorRT-LLM still verifies N tokens; the pad adds the best
    nodes by score until copies fit (here the best root child and its best child)."""
    history = fill_history(*random_draft(2, K, D, seed=3))
    tree = draft_tree_from_history(history)
    out = pad_with_copies(history, tree, torch.full((2, 1), -1), N)
    assert out.num_selected.tolist() == [0, 0] and out.num_extended.tolist() == [2, 2]
    assert out.is_copy.sum(1).tolist() == [N - 2, N - 2]
    for b in range(2):
        built = build_dynamic_tree(out.parents[b].tolist(), out.topk_score_indices[b].tolist(),
                                   out.draft_tokens[b].tolist(), K)
        assert len(set(paths(built)[1:])) == 2


def test_copies_stay_in_the_own_group_when_it_has_room():
    history = fill_history(*random_draft(1, K, D, seed=5))
    tree = draft_tree_from_history(history)
    out = pad_with_copies(history, tree, torch.tensor([[0, 1, -1]]), 6)  # two root children, room in group 0
    assert out.topk_score_indices.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert out.draft_tokens[0, 2:].tolist() == [int(history.draft_tokens[0, 0])] * 4
    assert torch.equal(out.parents, history.parents)  # no group re-pointed
    assert out.is_copy.tolist() == [[False, False, True, True, True, True]]


def test_repointed_groups_only_touch_unused_entries():
    history = fill_history(*random_draft(1, K, D, seed=8))
    tree = draft_tree_from_history(history)
    anchor = K + 2  # child 2 of root child 0 (group 1)
    out = pad_with_copies(history, tree, torch.tensor([[0, anchor]]), N)
    changed = (out.parents != history.parents).nonzero()[:, 1].tolist()
    assert changed and min(changed) > 1 and all(int(history.parents[0, g]) != 0 for g in changed)
    assert all(int(out.parents[0, g]) == 0 for g in changed)  # now children of the anchor's parent
    built = build_dynamic_tree(out.parents[0].tolist(), out.topk_score_indices[0].tolist(),
                               out.draft_tokens[0].tolist(), K)
    assert set(paths(built)[1:]) == {(int(history.draft_tokens[0, 0]),),
                                     (int(history.draft_tokens[0, 0]), int(history.draft_tokens[0, anchor]))}


def test_single_step_tree_and_bad_inputs():
    history = fill_history(*random_draft(1, K, 1, seed=2))  # max_draft_len 1: one group, no re-pointing
    tree = draft_tree_from_history(history)
    out = pad_with_copies(history, tree, torch.tensor([[3]]), 6)
    # Node 3 leaves 4 slots after it (4..7): one short, so the best node (0) joins and its copies fill 1, 2, 4, 5.
    assert out.num_extended.tolist() == [1] and out.topk_score_indices.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert out.is_copy.tolist() == [[False, True, True, False, True, True]]
    assert out.draft_tokens[0, [1, 2, 4, 5]].tolist() == [int(history.draft_tokens[0, 0])] * 4
    with pytest.raises(ValueError, match="exceeds the captured verify length"):
        pad_with_copies(history, tree, torch.arange(5)[None], 4)
    narrow = fill_history(*random_draft(1, 2, 1, seed=2))
    with pytest.raises(ValueError, match="cannot be padded"):
        pad_with_copies(narrow, draft_tree_from_history(narrow), torch.tensor([[-1]]), 3)


def test_worker_refuses_rejection_sampling_and_engines_turn_it_off(tmp_path):
    """The dynamic-tree rejection kernel tries siblings on one running sum of target probabilities
    (dynamicTreeKernels.cu, verifyDynamicTreeRejectionKernel), so a copy would be accepted as if it were a
    second token: the worker refuses it, and every profile YAML turns it off."""
    from types import SimpleNamespace

    from trtllm_moespec.backends.trtllm.config import speculative_config
    from trtllm_moespec.backends.trtllm.config import VerifyProfile
    from trtllm_moespec.backends.trtllm.presets import PRESETS, TreeDefaults

    history = fill_history(*peaked_draft(1, seed=1))

    class Base(_Worker):
        def __init__(self, spec_config, mapping):
            super().__init__(history, N)

    worker_cls = make_worker_class(Base)
    with pytest.raises(ValueError, match="use_rejection_sampling: false"):
        worker_cls(SimpleNamespace(use_rejection_sampling=True), None, moespec_settings=WorkerSettings("eagle3"))
    worker_cls(SimpleNamespace(use_rejection_sampling=False), None, moespec_settings=WorkerSettings("eagle3"))
    spec = speculative_config(PRESETS["qwen3-30b-a3b"], TreeDefaults(), VerifyProfile(32, 4, "p.yaml"), "/d", "tree")
    assert spec["use_rejection_sampling"] is False
