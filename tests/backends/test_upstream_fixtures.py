"""The adapter and its stand-ins checked against pinned TensorRT-LLM text, not against our reading (issue 29, 5).

tests/backends/fixtures/trtllm/ holds verbatim excerpts (file, 40-hex commit, license in each header).
These tests run TensorRT-LLM's own functions from them, or compare their AST with our code, so drift is
found by replacing an excerpt with the same span at a newer commit.
"""

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.backends.test_buffers import fill_history, random_draft
from tests.backends.upstream import (class_fields, excerpt, field_aliases, find, header, load_function,
                                     self_attributes)
from trtllm_moespec.backends.trtllm import schema
from trtllm_moespec.backends.trtllm.buffers import history_size, parent_buffer_size, top_n_resampling
from trtllm_moespec.backends.trtllm.worker import BATCH_CONTRACTS, wants_dynamic_tree

ROOT = Path(__file__).resolve().parents[2]
DYNAMIC_TREE = "eagle3_dynamic_tree_excerpt.py"
LLM_ARGS = "llm_args_excerpt.py"
PYTHON_PLUGIN = "python_plugin_excerpt.py"
SPEC_UTILS = "spec_utils_excerpt.py"


@pytest.mark.parametrize("name", [DYNAMIC_TREE, LLM_ARGS, PYTHON_PLUGIN, SPEC_UTILS])
def test_every_excerpt_names_file_commit_and_license(name):
    h = header(name)
    assert h["Source"].startswith("NVIDIA/TensorRT-LLM  tensorrt_llm/")
    assert re.fullmatch(r"[0-9a-f]{40}", h["Commit"]) and h["License"].startswith("Apache-2.0")
    assert "SPDX-License-Identifier: Apache-2.0" in (Path(__file__).parent / "fixtures" / "trtllm" / name).read_text()


def test_top_n_resampling_is_trtllms_resample_final_tokens():
    theirs = load_function(DYNAMIC_TREE, "_resample_final_tokens")
    for seed, (B, K, D, N) in enumerate([(2, 4, 3, 8), (3, 8, 4, 32), (1, 2, 2, 2)]):
        history = fill_history(*random_draft(B, K, D, seed=seed))
        want_tokens, want_idx = theirs(history.scores, history.draft_tokens, N)
        tokens, idx = top_n_resampling(history, N)
        assert torch.equal(idx, want_idx) and torch.equal(tokens, want_tokens)


def _run_upstream_draft_loop(root_ids, root_probs, step_ids, step_probs):
    """TensorRT-LLM's update_draft_tokens_and_scores, step by step, on an object holding its buffers."""
    select = load_function(DYNAMIC_TREE, "_select_topk_draft_tokens")
    update = load_function(DYNAMIC_TREE, "update_draft_tokens_and_scores",
                           {"_select_topk_draft_tokens": select, "AttentionMetadata": object})
    B, K = root_ids.shape
    D = 1 + len(step_ids)
    worker = SimpleNamespace(
        K=K, max_draft_len=D, draft_tokens_buffer=torch.zeros(B, K * D, dtype=torch.int32),
        history_draft_tokens_buffer=torch.zeros(B, history_size(K, D), dtype=torch.int32),
        history_score_buffer=torch.zeros(B, history_size(K, D)),
        history_draft_tokens_parent_buffer=torch.zeros(B, parent_buffer_size(K, D), dtype=torch.int64),
        _parent_init_arange=torch.arange(-1, K), prepare_tree_mask_and_position_offset=lambda *a: None)
    previous = update(worker, 0, root_ids.int(), root_probs, None, B)
    for layer, (ids, probs) in enumerate(zip(step_ids, step_probs), start=1):
        previous = update(worker, layer, ids.int(), probs, previous, B)
    return worker


@pytest.mark.parametrize("B,K,D", [(2, 2, 3), (3, 4, 4), (2, 8, 4)])
def test_history_buffers_the_tests_fill_are_trtllms(B, K, D):
    """fill_history (what every backend test feeds the worker) equals TensorRT-LLM's own draft-loop writes."""
    draft = random_draft(B, K, D, seed=B + 10 * K + 100 * D)
    upstream = _run_upstream_draft_loop(*draft)
    ours = fill_history(*draft)
    assert torch.equal(ours.draft_tokens, upstream.history_draft_tokens_buffer)
    assert torch.equal(ours.parents, upstream.history_draft_tokens_parent_buffer)
    torch.testing.assert_close(ours.scores, upstream.history_score_buffer)


def test_worker_reads_only_what_trtllms_worker_holds():
    """The attributes our subclass reads from TensorRT-LLM's worker are the ones its methods use."""
    tree = ast.parse((ROOT / "trtllm_moespec" / "backends" / "trtllm" / "worker.py").read_text())
    ours = {a for a in self_attributes(find(tree, "MoESpecDynamicTreeWorker"))
            if not a.startswith("_moespec") and a != "moespec_settings"}
    cls = find(excerpt(DYNAMIC_TREE), "Eagle3OneModelDynamicTreeWorker")
    assert ours == {"K", "max_draft_len", "max_total_draft_tokens", "history_draft_tokens_buffer",
                    "history_score_buffer", "history_draft_tokens_parent_buffer"}
    assert ours <= self_attributes(cls)


def test_dynamic_tree_dispatch_and_get_spec_worker_signature_are_trtllms():
    theirs = load_function(SPEC_UTILS, "_is_effective_dynamic_tree")
    mode = SimpleNamespace(is_eagle3_one_model=lambda: True)
    for dynamic in (False, True):
        for topk in (0, 1, 2, 8):
            cfg = SimpleNamespace(spec_dec_mode=mode, use_dynamic_tree=dynamic, dynamic_tree_max_topK=topk)
            assert wants_dynamic_tree(cfg) == theirs(cfg)  # our mirror, used when utils lacks the helper
    args = find(excerpt(SPEC_UTILS), "get_spec_worker").args
    upstream = [a.arg for a in args.args]
    assert upstream == ["spec_config", "model_config", "mapping", "use_separate_draft_kv_cache"]
    from tests.backends.trtllm_standin import UTILS  # the on-disk stand-in's signature is upstream's
    assert "def get_spec_worker(spec_config, model_config, mapping, use_separate_draft_kv_cache: bool = False)" in UTILS


def test_schema_field_names_are_trtllms():
    tree = excerpt(LLM_ARGS)
    spec_fields, aliases = set(), set()
    for cls in ("DecodingBaseConfig", "EagleDecodingConfig", "Eagle3DecodingConfig"):
        public, private, _ = class_fields(tree, cls)
        spec_fields |= public
        aliases |= field_aliases(tree, cls)
    # max_batch_size is only for the older worker contract (added at run time, never in the YAML): here it is
    # private, which is the contract worker.BATCH_CONTRACTS calls "private".
    assert schema.SPECULATIVE_CONFIG_FIELDS - {"max_batch_size"} <= spec_fields | aliases
    assert "max_batch_size" not in spec_fields and "_max_batch_size" in class_fields(tree, "Eagle3DecodingConfig")[1]
    assert BATCH_CONTRACTS["private"] == "spec_config._max_batch_size"
    assert schema.CUDA_GRAPH_CONFIG_FIELDS <= class_fields(tree, "BaseCudaGraphConfig")[0]
    backend = class_fields(tree, "MoeConfig")[2]["backend"]
    literal = tuple(e.value for e in backend.slice.elts)
    assert schema.MOE_BACKENDS == literal and schema.MOE_CONFIG_FIELDS <= class_fields(tree, "MoeConfig")[0]
    use_rejection = next(s for s in find(tree, "DecodingBaseConfig").body
                         if isinstance(s, ast.AnnAssign) and s.target.id == "use_rejection_sampling")
    default = next(k.value.value for k in use_rejection.value.keywords if k.arg == "default")
    assert default is False  # the engines still write it explicitly (padding.py needs exact-match verification)


def test_python_plugin_against_trtllms_plugin_module():
    tree = excerpt(PYTHON_PLUGIN)
    decorator = find(tree, "trtllm_plugin").args
    kwonly = {a.arg for a in decorator.kwonlyargs}
    ours = ast.parse((ROOT / "trtllm_moespec" / "backends" / "trt_plugin" / "plugin.py").read_text())
    call = next(d for n in ast.walk(ours) if isinstance(n, ast.ClassDef) for d in n.decorator_list
                if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "trtllm_plugin")
    assert {k.arg for k in call.keywords} <= kwonly and len(call.args) == len(decorator.args) == 1
    for method in ("forward", "shape_dtype_inference"):
        theirs = [a.arg for a in find(find(tree, "PluginBase"), method).args.args]
        mine = [a.arg for a in find(find(ours, "MoESpecTreeSelectPlugin"), method).args.args]
        assert mine == theirs, method
    # What python_plugin imports from _utils, and what it does not (we import convert_to_torch_tensor there).
    from_utils = {a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "_utils" for a in n.names}
    assert {"TensorWrapper", "trt_dtype_to_torch"} <= from_utils <= schema.TRTLLM_MODULE_LAYOUT["tensorrt_llm._utils"] | {
        "np_dtype_to_trt", "str_dtype_to_trt", "torch_dtype_to_trt"}
    assert "convert_to_torch_tensor" not in from_utils
    namespace_import = {a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "plugin.plugin"
                        for a in n.names}
    assert namespace_import == schema.TRTLLM_MODULE_LAYOUT["tensorrt_llm.plugin.plugin"]
    # The Python route serialises a pickled instance (why it cannot share the native plugin's identity).
    create = find(find(tree, "PluginCreatorBase"), "create_plugin")
    assert "__plugin_pickle_obj__" in {n.value for n in ast.walk(create) if isinstance(n, ast.Constant)}
