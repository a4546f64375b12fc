"""Selection inside TensorRT-LLM's worker: graph safety (host syncs trapped) and joint/ecospec
equal to the PyTorch engine's selection on the same trees.

History buffers are filled as TensorRT-LLM's draft loop fills them (test_buffers.fill_history);
the drafter's hidden states reach the worker through the same hook calls
(`update_hidden_states`, `prepare_for_generation`) and shapes as in
eagle3_dynamic_tree.py @ 057c8a65145bb53caf3939ba4fbcabbad46ea3dc.
"""

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch

from tests.backends.test_buffers import fill_history, random_draft
from trtllm_moespec.backends.trtllm.buffers import (DynamicTreeHistory, device_score_order, draft_tree_from_history,
                                                    selected_parent_positions)
from trtllm_moespec.backends.trtllm.selection import HistoryExpertPredictor, WorkerSettings, make_selector
from trtllm_moespec.backends.trtllm.worker import ExpertInputs, make_worker_class, moespec_resampling
from trtllm_moespec.core.cost import CostTable, ExpertCostModel
from trtllm_moespec.core.policies import EcoSpecPolicy, JointPolicy
from trtllm_moespec.core.tree import DraftTree, score_order
from trtllm_moespec.engine.predictors import HeadExperts
from trtllm_moespec.models.predictor_head import DraftHeadPredictor, HeadPredictorConfig, HeadPredictorModel

B, K, D, N = 3, 4, 4, 16  # batch, topK, max_draft_len, verify length
VOCAB, HIDDEN, EMBED, LAYERS, EXPERTS = 1000, 16, 12, 3, 8

_state = threading.local()
_TRAPPED = ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__")


class HostSync(AssertionError):
    pass


@contextlib.contextmanager
def host_sync_traps():
    """Make every host synchronisation / host-list tensor construction raise (while not suspended)."""
    originals = {name: getattr(torch.Tensor, name) for name in _TRAPPED}
    factories = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}

    def trap(name, original):
        def method(self, *args, **kwargs):
            if getattr(_state, "suspended", False):
                return original(self, *args, **kwargs)
            raise HostSync(f"Tensor.{name} called inside the worker's selection")
        return method

    def trap_factory(name, original):
        def factory(data, *args, **kwargs):
            if not getattr(_state, "suspended", False) and not isinstance(data, torch.Tensor):
                raise HostSync(f"torch.{name} built from host data {type(data).__name__} inside the selection")
            return original(data, *args, **kwargs)
        return factory

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, trap(name, original))
        for name, original in factories.items():
            setattr(torch, name, trap_factory(name, original))
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for name, original in factories.items():
            setattr(torch, name, original)


@pytest.fixture
def op_exempt(monkeypatch):
    """The select_tree op itself is opaque to the trap: on CUDA it dispatches to the Triton kernels
    (kernels/op.py; their equality with the reference is tested in tests/kernels), on CPU to the
    reference, which reads its inputs on the host by design. Everything around it is trapped."""
    import trtllm_moespec.kernels as kernels

    original = kernels.select_tree

    def exempt(*args, **kwargs):
        _state.suspended = True
        try:
            return original(*args, **kwargs)
        finally:
            _state.suspended = False

    monkeypatch.setattr(kernels, "select_tree", exempt)


def test_traps_fire():
    x = torch.ones(2)
    with host_sync_traps():
        for call in (lambda: x.sum().item(), lambda: bool(x[0]), lambda: x.tolist(), lambda: torch.tensor([1, 2]),
                     lambda: x.cpu(), lambda: float(x[0])):
            with pytest.raises(HostSync):
                call()


def test_device_score_order_equals_core_score_order():
    g = torch.Generator().manual_seed(3)
    for seed in range(5):
        history = fill_history(*random_draft(B, K, D, seed=seed))
        tree = draft_tree_from_history(history)
        assert torch.equal(device_score_order(tree), score_order(tree))
    # ties in score: the shallower node, then the lower index, comes first
    parents = torch.tensor([[-1, -1, 0, 1, 2, -1]])
    probs = torch.tensor([[0.5, 0.5, 1.0, 1.0, 1.0, 0.0]])
    tree = DraftTree.from_parents(torch.arange(6)[None], parents, probs)
    tree = DraftTree(tree.token_ids, tree.parents, tree.depth, tree.draft_probs, tree.log_scores,
                     tree.valid & (torch.rand(1, 6, generator=g) >= 0))
    assert torch.equal(device_score_order(tree), score_order(tree))


@pytest.fixture
def predictor_dir(tmp_path):
    torch.manual_seed(0)
    cfg = HeadPredictorConfig(hidden_size=HIDDEN, embed_size=EMBED, vocab_size=VOCAB, target_num_layers=LAYERS,
                              target_num_experts=EXPERTS, target_topk=2, intermediate_size=32, max_depth=8)
    model = HeadPredictorModel(cfg)
    with torch.no_grad():
        model.depth_bias.weight.normal_(std=0.5)
        model.out.weight.normal_(std=1.0)
    return DraftHeadPredictor(model).save(tmp_path / "predictor", dtype=torch.float32)


@pytest.fixture
def cost_profile(tmp_path):
    table = CostTable(costs=tuple(0.010 + 0.0004 * k + 0.00002 * k * k for k in range(33)), model_id="m",
                      expert_model=ExpertCostModel(c0=0.010, c_tok=0.0002, c_exp=0.00004))
    return str(table.save(tmp_path / "cost_profile.json"))


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    history = fill_history(*random_draft(B, K, D, seed=seed, vocab=VOCAB))
    slot_hidden = torch.randn(B, K * (D - 1) + 1, HIDDEN, generator=g)
    root_ids = torch.randint(0, VOCAB, (B,), generator=g)
    embed = torch.nn.Embedding(VOCAB, EMBED)
    torch.nn.init.normal_(embed.weight, generator=g)
    return history, slot_hidden, root_ids, embed


@pytest.mark.parametrize("policy", ["eagle3", "evict", "ecospec", "joint"])
def test_worker_selection_never_syncs_with_the_host(policy, predictor_dir, cost_profile, op_exempt):
    history, slot_hidden, root_ids, embed = _inputs(seed=11)
    settings = WorkerSettings(policy=policy, cost_profile=cost_profile, predictor=str(predictor_dir))
    select = make_selector(settings, N)  # built once at init: may read files and copy to the device
    predictor = HistoryExpertPredictor(predictor_dir, EXPERTS, "cpu")
    experts = ExpertInputs(slot_hidden, root_ids, embed)
    with host_sync_traps():
        out = moespec_resampling(history, select, N, predictor=predictor, experts=experts)
    tokens, indices = out.draft_tokens, out.topk_score_indices
    assert tokens.shape == (B, N) and tokens.dtype == history.draft_tokens.dtype and (indices.diff(dim=1) > 0).all()
    with_parents = DynamicTreeHistory(history.draft_tokens, history.scores, out.parents, K, D)
    selected_parent_positions(with_parents, indices)  # parent-closed, as TensorRT-LLM's tree builder needs


def test_coverage_is_the_eager_policy(cost_profile):
    history, *_ = _inputs(seed=2)
    select = make_selector(WorkerSettings(policy="coverage", policy_options={"rho": 0.5}), N)
    with host_sync_traps(), pytest.raises(HostSync):
        moespec_resampling(history, select, N)


@pytest.mark.parametrize("policy", ["ecospec", "joint"])
def test_expert_policies_equal_the_pytorch_engine_on_the_same_trees(policy, predictor_dir, cost_profile):
    """Worker path (history buffers, per-slot hidden, graph-safe head, select_tree op) == the PyTorch
    engine's path (HeadExperts over node_hidden + the core policy) for every request of the batch."""
    head = DraftHeadPredictor.load(predictor_dir)
    for seed in (5, 6):
        history, slot_hidden, root_ids, embed = _inputs(seed)
        tree = draft_tree_from_history(history)
        select = make_selector(WorkerSettings(policy=policy, cost_profile=cost_profile, predictor=str(predictor_dir)),
                               N)
        predictor = HistoryExpertPredictor(predictor_dir, EXPERTS, "cpu")
        node_bits, root_bits = predictor.predict(history, slot_hidden, root_ids, embed)
        got = select(tree, node_bits, root_bits)
        engine_experts = HeadExperts(head, embed, EXPERTS)
        if policy == "joint":
            core = JointPolicy(cost_model=CostTable.load(cost_profile).expert_model, budget=N)
        else:
            core = EcoSpecPolicy(budget=N, eps=1e-3)
        slot = torch.arange(tree.num_nodes) // K
        for b in range(B):
            one = DraftTree(*(getattr(tree, f)[b : b + 1] for f in DraftTree.__dataclass_fields__))
            draft = SimpleNamespace(node_hidden=slot_hidden[b, slot][None])
            experts, root = engine_experts.predict([int(root_ids[b])], one, draft, cache=None)
            want = core.select(one, experts=experts, root_experts=root)
            assert set(got[b][got[b] >= 0].tolist()) == set(want.node_idx[0][want.node_idx[0] >= 0].tolist()), b
            assert torch.equal(node_bits[b : b + 1], experts.bits) and torch.equal(root_bits[b : b + 1], root)
        assert 0 < int((got >= 0).sum(1).min()) and int((got >= 0).sum(1).max()) <= N


class _DynamicTreeWorker:
    """TensorRT-LLM's Eagle3OneModelDynamicTreeWorker reduced to what the subclass touches (buffers as
    allocated in its __init__, the three hook methods as no-ops that keep their signatures)."""

    def __init__(self, spec_config, mapping, use_separate_draft_kv_cache=False):
        self.K, self.max_draft_len = K, D
        self.max_total_draft_tokens = N
        self.history_draft_tokens_buffer = torch.zeros(B, K + K * K * (D - 1), dtype=torch.int32)
        self.history_score_buffer = torch.zeros(B, K + K * K * (D - 1))
        self.history_draft_tokens_parent_buffer = torch.zeros(B, max(K * (D - 1) + 1, K + 1), dtype=torch.int64)

    def _forward_draft_loop(self, inputs, attn_metadata, spec_metadata, draft_model, *args):
        return None

    def prepare_for_generation(self, cur_draft_idx, attn_metadata, batch_size, *, inputs=None, gather_ids=None,
                               **kwargs):
        return None

    def update_hidden_states(self, cur_draft_idx, batch_size, step0_hs=None, hidden_states_to_save=None,
                             selected_parents=None):
        return None


def test_worker_records_hidden_per_slot_during_the_draft_loop(predictor_dir, cost_profile, op_exempt):
    """Drive the subclass through the hook calls of _forward_draft_loop, then select under the traps."""
    history, slot_hidden, root_ids, embed = _inputs(seed=8)
    worker_cls = make_worker_class(_DynamicTreeWorker)
    worker = worker_cls(None, None, moespec_settings=WorkerSettings(policy="joint", cost_profile=cost_profile,
                                                                    predictor=str(predictor_dir)),
                        moespec_num_experts=EXPERTS)
    worker.history_draft_tokens_buffer.copy_(history.draft_tokens)
    worker.history_score_buffer.copy_(history.scores)
    worker.history_draft_tokens_parent_buffer.copy_(history.parents)
    draft_model = SimpleNamespace(model=SimpleNamespace(embed_tokens=embed))
    worker._forward_draft_loop({}, None, None, draft_model)
    gather_ids = torch.tensor([2, 5, 9])
    input_ids = torch.zeros(12, dtype=torch.int64)
    input_ids[gather_ids] = root_ids
    with host_sync_traps():
        worker.prepare_for_generation(0, None, B, inputs={"input_ids": input_ids}, gather_ids=gather_ids)
        worker.update_hidden_states(0, B, step0_hs=slot_hidden[:, 0])
        for layer in range(1, D):  # growing context: l*K tokens per request, the last K are the frontier
            context = torch.randn(B, layer * K, HIDDEN)
            context[:, -K:] = slot_hidden[:, 1 + (layer - 1) * K : 1 + layer * K]
            worker.update_hidden_states(layer, B, hidden_states_to_save=context.reshape(B * layer * K, HIDDEN))
        tokens, indices = worker.resampling_final_draft_tokens(B)
    assert torch.equal(worker._moespec_slot_hidden, slot_hidden) and torch.equal(worker._moespec_root_ids, root_ids)
    want = moespec_resampling(history, make_selector(worker.moespec_settings, N), N,
                              predictor=HistoryExpertPredictor(predictor_dir, EXPERTS, "cpu"),
                              experts=ExpertInputs(slot_hidden, root_ids, embed))
    assert torch.equal(indices, want.topk_score_indices) and torch.equal(tokens, want.draft_tokens)
    assert torch.equal(worker.history_draft_tokens_parent_buffer, want.parents)
