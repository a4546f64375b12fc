"""The MoESpec worker for TensorRT-LLM's PyTorch backend, and how it is swapped in.

TensorRT-LLM's `Eagle3OneModelDynamicTreeWorker` (tensorrt_llm/_torch/speculative/
eagle3_dynamic_tree.py) drafts an EAGLE-3 tree into history buffers and then
prunes it once, in `resampling_final_draft_tokens(batch_size)`, to the top-N nodes
by score (N = max_total_draft_tokens, the verify length its CUDA graphs were
captured for). `MoESpecDynamicTreeWorker` overrides exactly that method: it turns
the history buffers into our DraftTree (buffers.py), lets our selection choose the
nodes, pads the choice to N with the next-best nodes (the graph verifies N) and
returns the same (draft tokens, sorted history indices) pair.

EVICT runs through the `moespec::select_tree` custom op (trtllm_moespec.kernels:
Triton on CUDA, no host synchronisation, so it can live inside TensorRT-LLM's
captured graphs). eagle3 and coverage run the core policy in eager PyTorch, which
synchronises with the host: run TensorRT-LLM without CUDA graphs for those.

There is no worker registry in TensorRT-LLM: workers come from
`tensorrt_llm._torch.speculative.utils.get_spec_worker`, which
`tensorrt_llm._torch.speculative` re-exports and `..models.modeling_speculative`
imports by name. `install()` wraps that function and rebinds every loaded module
attribute that still points to the original.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ...core.tree import DraftTree
from .buffers import DynamicTreeHistory, draft_tree_from_history, selection_to_trtllm
from .version import check_version

log = logging.getLogger(__name__)

SPEC_UTILS_MODULE = "tensorrt_llm._torch.speculative.utils"
DYNAMIC_TREE_MODULE = "tensorrt_llm._torch.speculative.eagle3_dynamic_tree"
BASE_WORKER_NAME = "Eagle3OneModelDynamicTreeWorker"
WORKER_FACTORY_NAME = "get_spec_worker"
# Policies whose selection needs only the draft tree (+ a cost table): the worker
# has no per-node expert predictions inside TensorRT-LLM yet.
TREE_ONLY_POLICIES = ("eagle3", "evict", "coverage")

Selector = Callable[[DraftTree], torch.Tensor]  # tree -> node_idx [B, K] (-1 pad)


@dataclass(frozen=True)
class WorkerSettings:
    """What the worker needs from the engine directory."""

    policy: str  # one of TREE_ONLY_POLICIES
    cost_profile: str | None = None  # cost_profile.json (evict needs it)
    policy_options: dict[str, Any] = field(default_factory=dict)


def check_worker_policy(policy: str) -> None:
    """Raise ValueError unless the TensorRT-LLM worker can run `policy`."""
    if policy not in TREE_ONLY_POLICIES:
        raise ValueError(
            f"policy {policy!r} cannot run inside the TensorRT-LLM worker: it needs per-node expert predictions, "
            f"which the worker does not compute yet; use one of {TREE_ONLY_POLICIES} there, or the PyTorch engine"
        )


def make_selector(settings: WorkerSettings, verify_length: int) -> Selector:
    """A function tree -> selected node_idx for the captured verify length.

    Raises ValueError for policies the worker cannot run (expert-aware ones) and
    for evict without a cost profile.
    """
    check_worker_policy(settings.policy)
    from ...core.policies import make_policy

    options = dict(settings.policy_options)
    options.setdefault("budget", verify_length)
    if settings.policy == "evict":
        if settings.cost_profile is None:
            raise ValueError("policy 'evict' needs the engine's cost_profile.json (build without --dry-run on a GPU)")
        from ...core.cost import CostTable

        options["cost_table"] = CostTable.load(settings.cost_profile)
    policy = make_policy(settings.policy, **options)
    if settings.policy == "evict":
        return _evict_op_selector(options["cost_table"], options["budget"])
    return lambda tree: policy.select(tree).node_idx


def _evict_op_selector(cost_table: Any, budget: int) -> Selector:
    """EVICT through the `moespec::select_tree` op (Triton on CUDA, graph-capturable)."""
    from ...kernels import select_tree

    def select(tree: DraftTree) -> torch.Tensor:
        B, N = tree.token_ids.shape
        no_bits = torch.zeros(B, N, 1, dtype=torch.int64, device=tree.scores.device)  # evict ignores experts
        table = cost_table.as_tensor(tree.scores.device)
        return select_tree(tree.scores, tree.parents, tree.valid, tree.depth, no_bits, no_bits[:, 0], table,
                           "evict", budget).node_idx

    return select


def moespec_resampling(
    history: DynamicTreeHistory, select: Selector, verify_length: int, checks: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our replacement of resampling_final_draft_tokens, as a pure function.

    Returns (real_draft_tokens [B, N] int32, topk_score_indices [B, N] int64 ascending).
    """
    tree = draft_tree_from_history(history, checks=checks)
    selection = selection_to_trtllm(history, tree, select(tree), verify_length, checks=checks)
    return selection.draft_tokens, selection.topk_score_indices


def make_worker_class(base: type) -> type:
    """Subclass TensorRT-LLM's dynamic-tree worker class `base` (passed in, so this is testable)."""

    class MoESpecDynamicTreeWorker(base):
        """Eagle3 dynamic-tree worker whose final pruning is MoESpec's selection."""

        def __init__(self, *args: Any, moespec_settings: WorkerSettings, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.moespec_settings = moespec_settings
            self._moespec_select = make_selector(moespec_settings, self.max_total_draft_tokens)

        def resampling_final_draft_tokens(self, batch_size: int):
            history = DynamicTreeHistory(
                draft_tokens=self.history_draft_tokens_buffer[:batch_size],
                scores=self.history_score_buffer[:batch_size],
                parents=self.history_draft_tokens_parent_buffer[:batch_size],
                topk=self.K,
                max_draft_len=self.max_draft_len,
            )
            return moespec_resampling(history, self._moespec_select, self.max_total_draft_tokens)

    MoESpecDynamicTreeWorker.__qualname__ = "MoESpecDynamicTreeWorker"
    return MoESpecDynamicTreeWorker


def _wants_dynamic_tree(spec_config: Any) -> bool:
    mode = getattr(spec_config, "spec_dec_mode", None)
    is_eagle3_one_model = getattr(mode, "is_eagle3_one_model", None)
    return bool(is_eagle3_one_model and is_eagle3_one_model() and getattr(spec_config, "use_dynamic_tree", False))


def wrap_get_spec_worker(original: Callable, worker_cls: type, settings: WorkerSettings) -> Callable:
    """A get_spec_worker that returns `worker_cls` for Eagle3 one-model dynamic trees."""
    signature = inspect.signature(original)
    if not {"spec_config", "mapping"} <= set(signature.parameters):
        raise RuntimeError(f"{WORKER_FACTORY_NAME}{signature} lacks spec_config/mapping; this tensorrt_llm is not supported")

    @functools.wraps(original)
    def get_spec_worker(*args: Any, **kwargs: Any):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        spec_config = bound.arguments["spec_config"]
        if not _wants_dynamic_tree(spec_config):
            return original(*args, **kwargs)
        extra = {}
        if "use_separate_draft_kv_cache" in bound.arguments:
            extra["use_separate_draft_kv_cache"] = bound.arguments["use_separate_draft_kv_cache"]
        return worker_cls(spec_config, bound.arguments["mapping"], moespec_settings=settings, **extra)

    get_spec_worker.__moespec_original__ = original  # type: ignore[attr-defined]
    return get_spec_worker


@dataclass(frozen=True)
class InstallRecord:
    worker_cls: type  # the MoESpecDynamicTreeWorker class that was installed
    patched_modules: tuple[str, ...]  # modules whose get_spec_worker now points to the wrapper


def install(settings: WorkerSettings, version: str | None = None) -> InstallRecord:
    """Swap MoESpec's worker into the imported tensorrt_llm; idempotent.

    version: override of the version to check (None = the installed tensorrt_llm's).
    Raises UnsupportedTensorRTLLMVersion, ValueError (policy) or RuntimeError
    (internals not where 1.2.x has them).
    """
    check_version(version)
    check_worker_policy(settings.policy)
    utils = importlib.import_module(SPEC_UTILS_MODULE)
    dyn = importlib.import_module(DYNAMIC_TREE_MODULE)
    base = getattr(dyn, BASE_WORKER_NAME, None)
    current = getattr(utils, WORKER_FACTORY_NAME, None)
    if base is None or current is None:
        raise RuntimeError(f"tensorrt_llm lacks {DYNAMIC_TREE_MODULE}.{BASE_WORKER_NAME} or {SPEC_UTILS_MODULE}.{WORKER_FACTORY_NAME}")
    original = getattr(current, "__moespec_original__", current)
    worker_cls = make_worker_class(base)
    wrapper = wrap_get_spec_worker(original, worker_cls, settings)
    patched = []
    for name, module in list(sys.modules.items()):
        if (name == "tensorrt_llm" or name.startswith("tensorrt_llm.")) and module is not None:
            value = getattr(module, WORKER_FACTORY_NAME, None)
            if value is not None and getattr(value, "__moespec_original__", value) is original:
                setattr(module, WORKER_FACTORY_NAME, wrapper)
                patched.append(name)
    log.warning("MoESpec worker installed into tensorrt_llm (%s), policy %s", ", ".join(sorted(patched)), settings.policy)
    return InstallRecord(worker_cls, tuple(sorted(patched)))


def uninstall() -> tuple[str, ...]:
    """Restore TensorRT-LLM's own get_spec_worker wherever install() replaced it."""
    restored = []
    for name, module in list(sys.modules.items()):
        if (name == "tensorrt_llm" or name.startswith("tensorrt_llm.")) and module is not None:
            value = getattr(module, WORKER_FACTORY_NAME, None)
            original = getattr(value, "__moespec_original__", None)
            if original is not None:
                setattr(module, WORKER_FACTORY_NAME, original)
                restored.append(name)
    return tuple(sorted(restored))
