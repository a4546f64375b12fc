"""Version check and worker installation against stand-in tensorrt_llm modules.

TensorRT-LLM cannot be installed on these CPU machines, so the module tree that
install() patches is built here from types.ModuleType objects with the same names
and signatures as tensorrt_llm 1.2.x (the only stand-ins in the test suite).
The selection itself is real: history buffers filled as TRT-LLM fills them. Where the stand-in
compares with TensorRT-LLM's own behaviour, it runs TensorRT-LLM's text from the pinned excerpts
(tests/backends/fixtures/trtllm/: `_resample_final_tokens`, `_is_effective_dynamic_tree`).
"""

import sys
import types

import pytest
import torch

from tests.backends.test_buffers import fill_history, random_draft
from tests.backends.upstream import load_function
from trtllm_moespec.backends.trtllm.buffers import DynamicTreeHistory, selected_parent_positions
from trtllm_moespec.backends.trtllm.version import (UnsupportedTensorRTLLMVersion, check_effective_draft_tokens,
                                                    check_engine_mode, supported_mode)
from trtllm_moespec.backends.trtllm.worker import (
    WorkerSettings,
    install,
    make_selector,
    moespec_resampling,
    uninstall,
    wants_dynamic_tree,
)

TREE_VERSION = "1.3.0rc9"  # a dynamic-tree line version (with the module present)
RESAMPLE_FINAL_TOKENS = load_function("eagle3_dynamic_tree_excerpt.py", "_resample_final_tokens")
IS_EFFECTIVE_DYNAMIC_TREE = load_function("spec_utils_excerpt.py", "_is_effective_dynamic_tree")


@pytest.mark.parametrize(
    "version,has_module,mode",
    [("1.2.0", False, "chain"), ("1.2.7", False, "chain"), ("1.2.0.post1", False, "chain"),
     ("1.3.0rc9", True, "tree"), ("1.3.2", True, "tree"), ("1.3.0rc4", False, "chain"), ("1.2.0rc2", False, None),
     ("1.1.0", False, None), ("2.0.0", True, None), ("0.21.0", False, None)],
)
def test_version_policy(version, has_module, mode):
    """1.2.x: linear only; the dynamic tree needs a 1.3+ build that has eagle3_dynamic_tree (PR #13081); a 1.3
    build without it still runs linear (chain) engines."""
    if mode is None:
        with pytest.raises(UnsupportedTensorRTLLMVersion, match=version.replace(".", "\\.")):
            supported_mode(version, has_module)
    else:
        assert supported_mode(version, has_module) == mode
        assert check_engine_mode("chain", version, has_module) == version


def test_tree_engine_on_1_2_names_the_version_and_what_to_do():
    with pytest.raises(UnsupportedTensorRTLLMVersion, match="1.2.3 does not have.*--trtllm-line 1.2"):
        check_engine_mode("tree", "1.2.3", False)
    with pytest.raises(UnsupportedTensorRTLLMVersion, match="lacks .*eagle3_dynamic_tree.*#13081"):
        check_engine_mode("tree", "1.3.0rc4", False)
    with pytest.raises(UnsupportedTensorRTLLMVersion, match="not a valid version"):
        check_engine_mode("tree", "nightly", True)


def test_effective_draft_tokens_must_equal_the_profile():
    class Cfg:
        max_total_draft_tokens, max_draft_len = 4, 4  # what 1.2.x leaves of a tree profile (v=16, steps=4)

    with pytest.raises(UnsupportedTensorRTLLMVersion, match="max_total_draft_tokens=4"):
        check_effective_draft_tokens(Cfg(), 16, 4)
    Cfg.max_total_draft_tokens = 16
    check_effective_draft_tokens(Cfg(), 16, 4)


class _Mode:
    def __init__(self, eagle3_one_model):
        self._e = eagle3_one_model

    def is_eagle3_one_model(self):
        return self._e


class _SpecConfig:
    _max_batch_size = 2  # what TensorRT-LLM fills in (the private batch-size contract)

    def __init__(self, dynamic, eagle3=True, topk=8):
        self.spec_dec_mode = _Mode(eagle3)
        self.use_dynamic_tree = dynamic
        self.dynamic_tree_max_topK = topk


def _fake_trtllm(monkeypatch, version=TREE_VERSION, history=None, verify_length=8, with_dynamic_tree=True):
    """Register tensorrt_llm, ._torch.speculative(.utils, .eagle3_dynamic_tree), ._torch.models.modeling_speculative."""
    names = [
        "tensorrt_llm",
        "tensorrt_llm._torch",
        "tensorrt_llm._torch.speculative",
        "tensorrt_llm._torch.speculative.utils",
        "tensorrt_llm._torch.speculative.eagle3_dynamic_tree",
        "tensorrt_llm._torch.models",
        "tensorrt_llm._torch.models.modeling_speculative",
    ]
    mods = {n: types.ModuleType(n) for n in names}
    mods["tensorrt_llm"].__version__ = version

    class Eagle3OneModelDynamicTreeWorker:
        def __init__(self, spec_config, mapping, use_separate_draft_kv_cache=False):
            self.spec_config, self.mapping, self.separate = spec_config, mapping, use_separate_draft_kv_cache
            self._max_batch_size = spec_config._max_batch_size
            history.validate()
            self.K, self.max_draft_len = history.topk, history.max_draft_len
            self.max_total_draft_tokens = verify_length
            self.history_draft_tokens_buffer = history.draft_tokens
            self.history_score_buffer = history.scores
            self.history_draft_tokens_parent_buffer = history.parents

        def resampling_final_draft_tokens(self, batch_size):
            # TensorRT-LLM's own text (the pinned excerpt), not our reading of it
            return RESAMPLE_FINAL_TOKENS(self.history_score_buffer[:batch_size, :],
                                         self.history_draft_tokens_buffer[:batch_size, :], self.max_total_draft_tokens)

    class LinearWorker:
        def __init__(self, spec_config, mapping):
            self.spec_config = spec_config

    def get_spec_worker(spec_config, model_config, mapping, use_separate_draft_kv_cache: bool = False):
        # main's dispatch, with its own _is_effective_dynamic_tree (utils.py @ 011d0933dcb5e592f5fa2626beaf42a96324c578, pinned excerpt)
        if spec_config.spec_dec_mode.is_eagle3_one_model() and IS_EFFECTIVE_DYNAMIC_TREE(spec_config):
            return Eagle3OneModelDynamicTreeWorker(spec_config, mapping, use_separate_draft_kv_cache)
        return LinearWorker(spec_config, mapping)

    mods["tensorrt_llm._torch.speculative.eagle3_dynamic_tree"].Eagle3OneModelDynamicTreeWorker = Eagle3OneModelDynamicTreeWorker
    for n in ("tensorrt_llm._torch.speculative.utils", "tensorrt_llm._torch.speculative", "tensorrt_llm._torch.models.modeling_speculative"):
        setattr(mods[n], "get_spec_worker", get_spec_worker)
    if not with_dynamic_tree:
        del mods["tensorrt_llm._torch.speculative.eagle3_dynamic_tree"]
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    return mods, get_spec_worker, Eagle3OneModelDynamicTreeWorker


def test_install_swaps_worker_everywhere_and_uninstall_restores(monkeypatch):
    history = fill_history(*random_draft(2, 4, 3, seed=5))
    mods, original, base = _fake_trtllm(monkeypatch, history=history, verify_length=8)
    record = install(WorkerSettings(policy="eagle3"))
    assert set(record.patched_modules) == {
        "tensorrt_llm._torch.speculative",
        "tensorrt_llm._torch.speculative.utils",
        "tensorrt_llm._torch.models.modeling_speculative",
    }
    factory = mods["tensorrt_llm._torch.models.modeling_speculative"].get_spec_worker
    assert factory is not original

    worker = factory(_SpecConfig(dynamic=True), None, "mapping", use_separate_draft_kv_cache=True)
    assert isinstance(worker, base) and type(worker).__name__ == "MoESpecDynamicTreeWorker"
    assert worker.mapping == "mapping" and worker.separate is True
    # eagle3 with budget = verify length reproduces TensorRT-LLM's own top-N pruning.
    ours_tokens, ours_idx = worker.resampling_final_draft_tokens(2)
    theirs_tokens, theirs_idx = base.resampling_final_draft_tokens(worker, 2)
    assert torch.equal(ours_idx, theirs_idx) and torch.equal(ours_tokens, theirs_tokens)
    assert ours_tokens.dtype == torch.int32 and ours_idx.shape == (2, 8)

    # Linear EAGLE-3 and other modes keep TensorRT-LLM's own worker.
    assert type(factory(_SpecConfig(dynamic=False), None, None)).__name__ == "LinearWorker"

    # A second install wraps the original, not the wrapper.
    install(WorkerSettings(policy="coverage", policy_options={"rho": 0.5}))
    again = mods["tensorrt_llm._torch.speculative.utils"].get_spec_worker
    assert again.__moespec_original__ is original

    assert set(uninstall()) == set(record.patched_modules)
    assert mods["tensorrt_llm._torch.speculative.utils"].get_spec_worker is original


def test_install_refuses_1_2_with_a_clear_error_and_checks_policies(monkeypatch):
    """On 1.2.x the dynamic-tree module does not exist: one clear error, not ModuleNotFoundError."""
    history = fill_history(*random_draft(1, 2, 2, seed=1))
    mods, original, _ = _fake_trtllm(monkeypatch, version="1.2.1", history=history, verify_length=2,
                                     with_dynamic_tree=False)
    monkeypatch.delitem(sys.modules, "tensorrt_llm._torch.speculative.eagle3_dynamic_tree", raising=False)
    with pytest.raises(UnsupportedTensorRTLLMVersion, match="tensorrt_llm 1.2.1 does not have"):
        install(WorkerSettings(policy="eagle3"))
    assert mods["tensorrt_llm._torch.speculative.utils"].get_spec_worker is original
    with pytest.raises(UnsupportedTensorRTLLMVersion, match="1.1.0 is not supported"):
        install(WorkerSettings(policy="eagle3"), version="1.1.0")
    with pytest.raises(ValueError, match="cannot run inside the TensorRT-LLM worker"):
        make_selector(WorkerSettings(policy="oracle"), 8)
    with pytest.raises(ValueError, match="cost_profile"):
        make_selector(WorkerSettings(policy="evict"), 8)
    with pytest.raises(ValueError, match="expert predictor"):
        make_selector(WorkerSettings(policy="ecospec"), 8)


def test_top_k_1_keeps_the_linear_worker_like_main(monkeypatch):
    """Main routes dynamic_tree_max_topK < 2 to the linear worker for worker, metadata and resource
    manager alike (_is_effective_dynamic_tree): ours must not build a tree worker there."""
    assert wants_dynamic_tree(_SpecConfig(dynamic=True, topk=8))
    assert not wants_dynamic_tree(_SpecConfig(dynamic=True, topk=1))
    assert not wants_dynamic_tree(_SpecConfig(dynamic=True, eagle3=False))

    class Utils:  # when the installed utils has the helper, its answer wins
        @staticmethod
        def _is_effective_dynamic_tree(cfg):
            return False

    assert not wants_dynamic_tree(_SpecConfig(dynamic=True, topk=8), Utils)
    history = fill_history(*random_draft(1, 2, 2, seed=1))
    mods, _, _ = _fake_trtllm(monkeypatch, history=history, verify_length=2)
    install(WorkerSettings(policy="eagle3"))
    factory = mods["tensorrt_llm._torch.speculative.utils"].get_spec_worker
    assert type(factory(_SpecConfig(dynamic=True, topk=1), None, None)).__name__ == "LinearWorker"


def _check_parent_closed(history, padded):
    """The padded selection with the parent buffer the worker hands to build_dynamic_tree."""
    with_parents = DynamicTreeHistory(history.draft_tokens, history.scores, padded.parents, history.topk,
                                      history.max_draft_len)
    selected_parent_positions(with_parents, padded.topk_score_indices)


def test_coverage_selection_is_padded_and_parent_closed():
    history = fill_history(*random_draft(3, 8, 4, seed=9))
    select = make_selector(WorkerSettings(policy="coverage", policy_options={"rho": 0.3}), 32)
    out = moespec_resampling(history, select, 32, checks=True)
    assert out.draft_tokens.shape == (3, 32) and (out.topk_score_indices.diff(dim=1) > 0).all()
    _check_parent_closed(history, out)


def test_evict_through_the_select_tree_op_matches_the_core_policy(tmp_path):
    from trtllm_moespec.backends.trtllm.buffers import draft_tree_from_history
    from trtllm_moespec.core.cost import CostTable
    from trtllm_moespec.core.policies import make_policy

    table = CostTable(costs=tuple(0.010 + 0.0004 * k + 0.00002 * k * k for k in range(33)), model_id="m")
    path = table.save(tmp_path / "cost_profile.json")
    history = fill_history(*random_draft(4, 8, 4, seed=21))
    tree = draft_tree_from_history(history)
    select = make_selector(WorkerSettings(policy="evict", cost_profile=str(path)), 32)
    got = select(tree)
    want = make_policy("evict", cost_table=table, budget=32).select(tree)
    assert torch.equal((got >= 0).sum(1), want.num_selected)
    assert 0 < int(want.num_selected.min()) and int(want.num_selected.max()) < 32  # the utility peak is interior
    for b in range(4):
        assert set(got[b][got[b] >= 0].tolist()) == set(want.node_idx[b][want.node_idx[b] >= 0].tolist())
    _check_parent_closed(history, moespec_resampling(history, select, 32, checks=True))


def test_dynamic_tree_support_follows_the_worker_constructor_contract(monkeypatch):
    """F9: the two dynamic-tree workers learn their batch capacity differently (eagle3_dynamic_tree.py @
    057c8a65145bb53caf3939ba4fbcabbad46ea3dc: spec_config._max_batch_size, filled by TensorRT-LLM; @
    470bb72055d5d397c60be4dda1e8f490e7002440: spec_config.max_batch_size, which the
    speculative_config must carry), under the same 1.3 pre-release version strings: support is decided on
    the constructor, not on the version."""
    from trtllm_moespec.backends.trtllm.config import with_batch_contract
    from trtllm_moespec.backends.trtllm.worker import worker_batch_contract

    class Private:
        def __init__(self, spec_config, mapping, use_separate_draft_kv_cache=False):
            self._max_batch_size = spec_config._max_batch_size

    class Public:
        def __init__(self, spec_config, mapping, use_separate_draft_kv_cache=False):
            if spec_config.max_batch_size is None:
                raise ValueError("requires max_batch_size")

    class Unknown:
        def __init__(self, spec_config, mapping, use_separate_draft_kv_cache=False):
            self.size = 8

    assert worker_batch_contract(Private) == "private" and worker_batch_contract(Public) == "public"
    with pytest.raises(RuntimeError, match="reads neither"):
        worker_batch_contract(Unknown)
    options = {"max_batch_size": 6, "speculative_config": {"decoding_type": "Eagle3", "max_draft_len": 4}}
    assert with_batch_contract(options, "private") == options
    assert with_batch_contract(options, "public")["speculative_config"]["max_batch_size"] == 6
    assert "max_batch_size" not in options["speculative_config"]  # not modified in place
    # install() refuses a worker whose contract it does not know, before patching anything.
    history = fill_history(*random_draft(1, 2, 2, seed=1))
    mods, original, _ = _fake_trtllm(monkeypatch, history=history, verify_length=2)
    mods["tensorrt_llm._torch.speculative.eagle3_dynamic_tree"].Eagle3OneModelDynamicTreeWorker = Unknown
    with pytest.raises(RuntimeError, match="reads neither"):
        install(WorkerSettings(policy="eagle3"))
    assert mods["tensorrt_llm._torch.speculative.utils"].get_spec_worker is original
