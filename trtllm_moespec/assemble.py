"""Build what `LLM` runs from a `ResolvedConfig` (config.py): the target, the tokenizer and the
speculative engine (policy, drafter, expert predictor, node values, guard, drafting stop rule,
prefix cache). Nothing here chooses a default: `resolve.resolve_config` decided them all.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .config import ResolvedConfig
from .core.cost import CostTable, expert_term_pays
from .core.policies import SelectionPolicy, make_policy
from .engine.config import TreeConfig
from .engine.engine import SpecEngine
from .models.checkpoint import parse_dtype
from .resolve import load_predictor, load_value_model

if TYPE_CHECKING:
    from .models.target import TargetModel

log = logging.getLogger(__name__)


def load_target(config: ResolvedConfig, shared: "TargetModel | None" = None, ep=None):
    """The target of `config` (or `shared`, another LLM's identical one), sharded over the ranks of
    `ep`, with its CUDA-graph runner set up; returns (target, expert placement or None)."""
    from .models.target import TargetModel

    runtime, path = config.runtime, config.paths.target
    if shared is None:
        target = TargetModel.load(path, device=config.device, dtype=runtime.dtype, model_impl=runtime.model_impl)
    else:
        target = _shared_target(shared, path, config.device, runtime.dtype, runtime.model_impl)
    placement = None
    if ep is not None:  # shard this rank's experts; every forward then runs on all ranks
        target = ep.leader_target(target, path, runtime.dtype, runtime.model_impl)
        placement = ep.placement
    if config.cuda_graphs:  # captured lazily, one bucket at a time, on first use
        from .models.cuda_graphs import verify_buckets

        target.use_verify_runner("graphs", verify_buckets(config.tree.max_draft_tokens))
    return target, placement


def assemble_engine(config: ResolvedConfig, target: "TargetModel", placement=None) -> SpecEngine:
    """The speculative engine over `target`: draft -> select -> verify -> commit, as `config` says."""
    from .engine.prefix_cache import PrefixCache

    tree, options = config.tree, dict(config.policy_options)
    if placement is not None and config.spec.ep_pricing and config.policy in ("ecospec", "joint"):
        options.setdefault("placement", placement)
    policy = build_policy(config.policy, tree, config.profile, options)
    source, eagle3 = _draft_source(config, target)
    predictor = None
    if policy.reads_experts:
        predictor = load_predictor("oracle" if config.oracle_predictor else None, config.paths, target, eagle3)
    values = load_value_model(config.spec.values, config.paths, target) if policy.uses_values else None
    prefix = config.runtime.prefix_cache
    return SpecEngine(target, policy, tree, source, predictor, _device_selector(config.device), values,
                      placement=placement, guard=_guard(config),
                      prefix_cache=PrefixCache(target, prefix) if prefix else None)


def build_policy(name: str, tree: TreeConfig, profile: CostTable | None, options: dict) -> SelectionPolicy:
    """Policy with defaults derived from the tree config and the cost profile."""
    opts = dict(options)
    if name in ("eagle3", "ddd", "coverage", "joint", "evict"):
        opts.setdefault("budget", tree.max_draft_tokens)
    if name == "evict" or (name == "oracle" and profile is not None):
        opts.setdefault("cost_table", profile)
    if name == "joint":
        if profile is None or profile.expert_model is None:
            raise ValueError("policy 'joint' needs a cost profile with an expert cost fit; run `moespec profile`")
        opts.setdefault("cost_model", profile.expert_model)
        opts.setdefault("cost_table", profile)
        if "expert_term" not in opts:
            opts["expert_term"], why = expert_term_pays(profile)
            log.info("joint on %s: %s", profile.model_id, why)
    return make_policy("eagle3" if name == "ddd" else name, **opts)


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer, or None when it ships none (its files were checked by resolve)."""
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:  # transformers and tokenizers raise many kinds; the user needs the files named
        raise ValueError(f"the tokenizer files in {path} (tokenizer.json, tokenizer_config.json) cannot be "
                         f"loaded: {type(e).__name__}: {e}") from e


def _draft_source(config: ResolvedConfig, target: "TargetModel"):
    """(the engine's draft source or None, the loaded EAGLE-3 drafter or None)."""
    from .engine.drafters import Eagle3Source, NgramSource

    tree = config.tree
    if config.drafter == "ngram":
        from .models.ngram import NgramConfig, NgramDrafter

        return NgramSource(NgramDrafter(NgramConfig(max_nodes=max(tree.num_tree_nodes, 1)))), None
    if config.drafter is None:
        return None, None
    from .models.eagle3 import load_eagle3

    eagle3 = load_eagle3(config.paths.draft, target=target)
    source = Eagle3Source(eagle3, tree.steps, tree.topk, config.ddd_threshold, _stop_rule(config))
    if config.cuda_graphs:  # a step commits at most steps + 1 tokens (the accepted path and the bonus)
        from .models.cuda_graphs import verify_buckets
        from .models.eagle3.graphs import make_drafter_runner, make_frontier_runner

        source.extend_runner = make_drafter_runner("graphs", eagle3, verify_buckets(tree.steps))
        source.frontier_runner = make_frontier_runner("graphs", eagle3, tree.topk)  # frontier <= topk
    return source, eagle3


def _guard(config: ResolvedConfig):
    """The resolved speculate-or-not rule (None: off)."""
    if config.guard == "off":
        return None
    from .engine.guard import Guard, GuardConfig

    profile = config.rules_profile
    table = profile.costs if profile is not None else None
    plain = profile.plain_step if profile is not None else None
    return Guard(GuardConfig(measured=config.guard == "measured"), table, plain, config.guard_prior)


def _stop_rule(config: ResolvedConfig):
    """The resolved drafting stop rule (None: draft every step to the tree's depth)."""
    if not config.draft_stop:
        return None
    from .core.drafting import DraftStopRule

    profile = config.rules_profile
    return DraftStopRule(profile.costs, profile.draft_forward, config.tree.steps)


def _shared_target(target, path: Path, device: torch.device, dtype: str, model_impl: str):
    """`target_model=`: another LLM's target, once it is the one this LLM would load."""
    from .models.target import TargetModel

    if not isinstance(target, TargetModel):
        raise ValueError(f"target_model must be another LLM's .target, got {type(target).__name__}")
    loaded = Path(getattr(target.model.config, "_name_or_path", "") or "")
    have = {"path": loaded.resolve(), "device": target.device, "dtype": target.dtype, "model_impl": target.model_impl}
    wanted = {"path": path.resolve(), "device": device, "dtype": parse_dtype(dtype), "model_impl": model_impl}
    differ = [f"{k} {have[k]} (this LLM: {wanted[k]})" for k in have if have[k] != wanted[k]]
    if differ:
        raise ValueError(f"target_model is not the target this LLM would load: its {', '.join(differ)}")
    return target


def _device_selector(device: torch.device):
    """On CUDA, selection runs as the moespec::select_tree device op (no host sync inside)."""
    if device.type != "cuda":
        return None
    from .kernels.select_policy import select_on_device

    return select_on_device
