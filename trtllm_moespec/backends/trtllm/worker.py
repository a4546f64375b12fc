"""The MoESpec worker for TensorRT-LLM's PyTorch backend, and how it is swapped in.

TensorRT-LLM's `Eagle3OneModelDynamicTreeWorker` (tensorrt_llm/_torch/speculative/
eagle3_dynamic_tree.py @ 057c8a65145bb53caf3939ba4fbcabbad46ea3dc) drafts an EAGLE-3 tree into history buffers and
prunes it once, in `resampling_final_draft_tokens(batch_size)`, to the top-N nodes by
score (N = max_total_draft_tokens, the verify length its CUDA graphs were captured
for). `MoESpecDynamicTreeWorker` overrides exactly that method: the history buffers
become our DraftTree (buffers.py), a selector chosen at init (selection.py) picks the
nodes on the device, and the choice is padded to N with copies of selected nodes that
wake no new experts and are never accepted (padding.py), which also re-points unused
entries of the parent buffer that build_dynamic_tree reads next.

For ecospec and joint the worker also records, during TensorRT-LLM's own drafting
loop, the drafter's pre-norm hidden state per parent-buffer slot
(`update_hidden_states`) and the last accepted token (`prepare_for_generation` at step
0); the draft-head expert predictor turns them into per-node expert sets just before
the selection. Nothing here synchronises with the host except the eager-only
`coverage` policy.

There is no worker registry in TensorRT-LLM: workers come from
`tensorrt_llm._torch.speculative.utils.get_spec_worker`, which
`tensorrt_llm._torch.speculative` re-exports and `..models.modeling_speculative`
imports by name. `install()` wraps that function and rebinds every loaded module
attribute that still points to the original. `reach.py` makes sure every process
that builds the model runs `install()`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .buffers import DynamicTreeHistory, draft_tree_from_history
from .padding import PaddedVerify, pad_with_copies
from .schema import DYNAMIC_TREE_MODULE
from .selection import (EXPERT_POLICIES, HistoryExpertPredictor, Selector, WorkerSettings, check_worker_policy,
                        make_selector)
from .version import check_engine_mode, dynamic_tree_available, installed_version

log = logging.getLogger(__name__)

SPEC_UTILS_MODULE = "tensorrt_llm._torch.speculative.utils"
BASE_WORKER_NAME = "Eagle3OneModelDynamicTreeWorker"
WORKER_FACTORY_NAME = "get_spec_worker"
EFFECTIVE_DYNAMIC_TREE_NAME = "_is_effective_dynamic_tree"  # utils.py @ 011d0933dcb5e592f5fa2626beaf42a96324c578

__all__ = ["WorkerSettings", "install", "uninstall", "make_worker_class", "moespec_resampling", "wants_dynamic_tree",
           "installed_worker_name", "make_selector"]


@dataclass(frozen=True)
class ExpertInputs:
    """What the expert predictor reads, captured during the drafting loop."""

    slot_hidden: torch.Tensor  # [B, P, Hd] pre-norm drafter hidden per parent-buffer slot
    root_ids: torch.Tensor  # [B] int64 last accepted token
    embed: Callable[[torch.Tensor], torch.Tensor]  # token ids -> target embeddings


def moespec_resampling(history: DynamicTreeHistory, select: Selector, verify_length: int, *,
                       predictor: HistoryExpertPredictor | None = None, experts: ExpertInputs | None = None,
                       checks: bool = False) -> PaddedVerify:
    """Our replacement of resampling_final_draft_tokens, as a pure function.

    checks=False is the graph-safe path (no shape checks, which read sizes on the host).
    Returns the selection padded to `verify_length` with copies (padding.py): its
    draft_tokens and topk_score_indices are what TensorRT-LLM's method returns, its
    parents what the worker's parent buffer must hold for build_dynamic_tree.
    """
    tree = draft_tree_from_history(history, checks=checks)
    node_bits = root_bits = None
    if select.needs_experts:
        if predictor is None or experts is None:
            raise ValueError("this policy needs per-node expert predictions: give the predictor and its inputs")
        node_bits, root_bits = predictor.predict(history, experts.slot_hidden, experts.root_ids, experts.embed)
    return pad_with_copies(history, tree, select(tree, node_bits, root_bits), verify_length, checks=checks)


def make_worker_class(base: type) -> type:
    """Subclass TensorRT-LLM's dynamic-tree worker class `base` (passed in, so this is testable)."""

    class MoESpecDynamicTreeWorker(base):
        """Eagle3 dynamic-tree worker whose final pruning is MoESpec's selection."""

        def __init__(self, *args: Any, moespec_settings: WorkerSettings, moespec_num_experts: int | None = None,
                     **kwargs: Any) -> None:
            spec_config = args[0] if args else kwargs.get("spec_config")
            if getattr(spec_config, "use_rejection_sampling", False):
                # Copies (padding.py) are exact under greedy and exact-match verification only: the target-only
                # rejection kernel sums sibling probabilities and would count a copied token twice.
                raise ValueError("the MoESpec worker pads with copies of selected nodes, which TensorRT-LLM's "
                                 "dynamic-tree rejection sampling would accept with the wrong probability: set "
                                 "speculative_config.use_rejection_sampling: false (moespec build writes it)")
            super().__init__(*args, **kwargs)
            self.moespec_settings = moespec_settings
            device = self.history_score_buffer.device
            self._moespec_select = make_selector(moespec_settings, self.max_total_draft_tokens, device)
            self._moespec_predictor = None
            if moespec_settings.policy in EXPERT_POLICIES:
                if moespec_num_experts is None:
                    raise ValueError("ecospec/joint in the worker need the target's number of experts")
                self._moespec_predictor = HistoryExpertPredictor(moespec_settings.predictor, moespec_num_experts, device)
            batch = self.history_score_buffer.shape[0]
            # Static buffers (their addresses are captured): root ids now, hidden slots on the first step 0.
            self._moespec_root_ids = torch.zeros(batch, dtype=torch.int64, device=device)
            self._moespec_slot_hidden = None
            self._moespec_embed = None

        def _forward_draft_loop(self, inputs, attn_metadata, spec_metadata, draft_model, *args, **kwargs):
            # The drafter shares the target's embedding unless their widths differ (`Eagle3DraftModel`,
            # tensorrt_llm/_torch/models/modeling_speculative.py @ 00679c66c3e38f6d2651ad0a5bef0f94d862e36c).
            self._moespec_embed = draft_model.model.embed_tokens
            return super()._forward_draft_loop(inputs, attn_metadata, spec_metadata, draft_model, *args, **kwargs)

        def prepare_for_generation(self, cur_draft_idx, attn_metadata, batch_size, *, inputs=None, gather_ids=None,
                                   **kwargs):
            if cur_draft_idx == 0 and self._moespec_predictor is not None:
                self._moespec_root_ids[:batch_size].copy_(inputs["input_ids"][gather_ids])
            return super().prepare_for_generation(cur_draft_idx, attn_metadata, batch_size, inputs=inputs,
                                                  gather_ids=gather_ids, **kwargs)

        def update_hidden_states(self, cur_draft_idx, batch_size, step0_hs=None, hidden_states_to_save=None,
                                 selected_parents=None):
            if self._moespec_predictor is not None:
                record_slot_hidden(self, cur_draft_idx, batch_size, step0_hs, hidden_states_to_save)
            return super().update_hidden_states(cur_draft_idx, batch_size, step0_hs=step0_hs,
                                                hidden_states_to_save=hidden_states_to_save,
                                                selected_parents=selected_parents)

        def resampling_final_draft_tokens(self, batch_size: int):
            history = DynamicTreeHistory(
                draft_tokens=self.history_draft_tokens_buffer[:batch_size],
                scores=self.history_score_buffer[:batch_size],
                parents=self.history_draft_tokens_parent_buffer[:batch_size],
                topk=self.K,
                max_draft_len=self.max_draft_len,
            )
            experts = None
            if self._moespec_predictor is not None:
                experts = ExpertInputs(self._moespec_slot_hidden[:batch_size], self._moespec_root_ids[:batch_size],
                                       self._moespec_embed)
            padded = moespec_resampling(history, self._moespec_select, self.max_total_draft_tokens,
                                        predictor=self._moespec_predictor, experts=experts)
            # build_dynamic_tree reads this buffer right after; groups a copy was moved into now point at
            # the copied node's parent (padding.py). The next drafting loop rewrites every entry it uses.
            self.history_draft_tokens_parent_buffer[:batch_size].copy_(padded.parents)
            return padded.draft_tokens, padded.topk_score_indices

    MoESpecDynamicTreeWorker.__qualname__ = "MoESpecDynamicTreeWorker"
    return MoESpecDynamicTreeWorker


def record_slot_hidden(worker: Any, cur_draft_idx: int, batch_size: int, step0_hs: torch.Tensor | None,
                       hidden_states_to_save: torch.Tensor | None) -> None:
    """Write one drafting step's proposing hidden states into the worker's slot buffer.

    Step 0: step0_hs [B, Hd] (the last accepted position) -> slot 0. Step l >= 1:
    hidden_states_to_save [B * l*K, Hd] (the growing context); its last K rows per
    request are the frontier that proposed this step's children -> slots 1+(l-1)K .. lK.
    """
    K = worker.K
    if cur_draft_idx == 0:
        slots = worker.history_draft_tokens_parent_buffer.shape[1]
        buf = worker._moespec_slot_hidden
        if buf is None or buf.shape[-1] != step0_hs.shape[-1] or buf.dtype != step0_hs.dtype:
            # Allocated on the first (eager warm-up) call, as TensorRT-LLM allocates its own hidden buffers.
            worker._moespec_slot_hidden = buf = torch.zeros(worker.history_score_buffer.shape[0], slots,
                                                            step0_hs.shape[-1], dtype=step0_hs.dtype,
                                                            device=step0_hs.device)
        buf[:batch_size, 0].copy_(step0_hs)
        return
    frontier = hidden_states_to_save.reshape(batch_size, cur_draft_idx * K, -1)[:, -K:]
    start = 1 + (cur_draft_idx - 1) * K
    worker._moespec_slot_hidden[:batch_size, start : start + K].copy_(frontier)


BATCH_CONTRACTS = {
    # eagle3_dynamic_tree.py @ 057c8a65145bb53caf3939ba4fbcabbad46ea3dc: `spec_config._max_batch_size`, a private
    # attribute TensorRT-LLM fills from the LLM's max_batch_size (llm_args.py @ 0004396720054fd8e205cbf616f21f0b57c6b412).
    "private": "spec_config._max_batch_size",
    # eagle3_dynamic_tree.py @ 470bb72055d5d397c60be4dda1e8f490e7002440: `spec_config.max_batch_size`, which the
    # speculative_config itself must carry, else the constructor raises.
    "public": "spec_config.max_batch_size",
}


def worker_batch_contract(worker_cls: type) -> str:
    """How the installed dynamic-tree worker learns its batch capacity: 'private' or 'public' (BATCH_CONTRACTS).

    Read from the constructor's source, not inferred from the version: both contracts exist
    under 1.3 pre-release version strings. RuntimeError when neither is found.
    """
    try:
        source = inspect.getsource(worker_cls.__init__)
    except (OSError, TypeError) as e:
        raise RuntimeError(f"cannot read {worker_cls.__name__}.__init__ to check its batch-size contract: {e}") from None
    for contract, pattern in BATCH_CONTRACTS.items():
        if pattern in source:
            return contract
    raise RuntimeError(f"{worker_cls.__name__}.__init__ reads neither {' nor '.join(BATCH_CONTRACTS.values())}: "
                       "this tensorrt_llm's dynamic-tree worker is not one trtllm_moespec was written against")


def installed_batch_contract() -> str:
    """worker_batch_contract of the installed tensorrt_llm's dynamic-tree worker (imports it)."""
    base = getattr(importlib.import_module(DYNAMIC_TREE_MODULE), BASE_WORKER_NAME, None)
    if base is None:
        raise RuntimeError(f"tensorrt_llm lacks {DYNAMIC_TREE_MODULE}.{BASE_WORKER_NAME}")
    return worker_batch_contract(base)


def wants_dynamic_tree(spec_config: Any, utils: Any = None) -> bool:
    """Whether TensorRT-LLM builds its dynamic-tree worker for `spec_config`.

    `_is_effective_dynamic_tree` (use_dynamic_tree and topK >= 2) decides for the worker, the
    metadata and the resource manager alike (tensorrt_llm/_torch/speculative/utils.py @
    011d0933dcb5e592f5fa2626beaf42a96324c578); we call it when the installed utils module has
    it, so our choice always agrees, and mirror it otherwise (an older utils.py, e.g. @
    3e906a0ed7c66ed4df90aa4856bf1a6c98ca7df6, builds no dynamic-tree worker at all).
    """
    mode = getattr(spec_config, "spec_dec_mode", None)
    is_eagle3_one_model = getattr(mode, "is_eagle3_one_model", None)
    if not (is_eagle3_one_model and is_eagle3_one_model()):
        return False
    effective = getattr(utils, EFFECTIVE_DYNAMIC_TREE_NAME, None)
    if effective is not None:
        return bool(effective(spec_config))
    return bool(getattr(spec_config, "use_dynamic_tree", False)) and getattr(spec_config, "dynamic_tree_max_topK", 0) > 1


def wrap_get_spec_worker(original: Callable, worker_cls: type, settings: WorkerSettings, utils: Any = None,
                         num_experts: int | None = None) -> Callable:
    """A get_spec_worker that returns `worker_cls` for Eagle3 one-model dynamic trees."""
    signature = inspect.signature(original)
    if not {"spec_config", "mapping"} <= set(signature.parameters):
        raise RuntimeError(f"{WORKER_FACTORY_NAME}{signature} lacks spec_config/mapping; this tensorrt_llm is not supported")

    @functools.wraps(original)
    def get_spec_worker(*args: Any, **kwargs: Any):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        spec_config = bound.arguments["spec_config"]
        if not wants_dynamic_tree(spec_config, utils):
            return original(*args, **kwargs)
        extra = {}
        if "use_separate_draft_kv_cache" in bound.arguments:
            extra["use_separate_draft_kv_cache"] = bound.arguments["use_separate_draft_kv_cache"]
        return worker_cls(spec_config, bound.arguments["mapping"], moespec_settings=settings,
                          moespec_num_experts=num_experts, **extra)

    get_spec_worker.__moespec_original__ = original  # type: ignore[attr-defined]
    get_spec_worker.__moespec_worker__ = worker_cls  # type: ignore[attr-defined]
    return get_spec_worker


@dataclass(frozen=True)
class InstallRecord:
    worker_cls: type  # the MoESpecDynamicTreeWorker class that was installed
    patched_modules: tuple[str, ...]  # modules whose get_spec_worker now points to the wrapper


def install(settings: WorkerSettings, version: str | None = None, num_experts: int | None = None) -> InstallRecord:
    """Swap MoESpec's worker into the imported tensorrt_llm; idempotent.

    version: override of the version to check (None = the installed tensorrt_llm's).
    Raises UnsupportedTensorRTLLMVersion (with what to do) before importing any
    internal module, ValueError (policy) or RuntimeError (internals moved).
    """
    check_engine_mode("tree", version or installed_version(), dynamic_tree_available())
    check_worker_policy(settings)
    utils = importlib.import_module(SPEC_UTILS_MODULE)
    dyn = importlib.import_module(DYNAMIC_TREE_MODULE)
    base = getattr(dyn, BASE_WORKER_NAME, None)
    current = getattr(utils, WORKER_FACTORY_NAME, None)
    if base is None or current is None:
        raise RuntimeError(f"tensorrt_llm lacks {DYNAMIC_TREE_MODULE}.{BASE_WORKER_NAME} or {SPEC_UTILS_MODULE}.{WORKER_FACTORY_NAME}")
    worker_batch_contract(base)  # an unknown constructor contract is refused before anything is patched
    original = getattr(current, "__moespec_original__", current)
    worker_cls = make_worker_class(base)
    wrapper = wrap_get_spec_worker(original, worker_cls, settings, utils, num_experts)
    patched = []
    for name, module in list(sys.modules.items()):
        if (name == "tensorrt_llm" or name.startswith("tensorrt_llm.")) and module is not None:
            value = getattr(module, WORKER_FACTORY_NAME, None)
            if value is not None and getattr(value, "__moespec_original__", value) is original:
                setattr(module, WORKER_FACTORY_NAME, wrapper)
                patched.append(name)
    log.warning("MoESpec worker installed into tensorrt_llm (%s), policy %s", ", ".join(sorted(patched)), settings.policy)
    return InstallRecord(worker_cls, tuple(sorted(patched)))


def installed_worker_name(spec_config: Any) -> str:
    """The class name the current `get_spec_worker` would build for `spec_config` (without building it)."""
    utils = importlib.import_module(SPEC_UTILS_MODULE)
    factory = getattr(utils, WORKER_FACTORY_NAME)
    worker_cls = getattr(factory, "__moespec_worker__", None)
    if worker_cls is not None and wants_dynamic_tree(spec_config, utils):
        return worker_cls.__name__
    if wants_dynamic_tree(spec_config, utils):
        return BASE_WORKER_NAME
    return "TensorRT-LLM linear EAGLE-3 worker"


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
