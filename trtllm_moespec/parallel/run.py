"""What each rank of an expert-parallel job runs.

Rank 0 builds the usual `LLM` (drafter, predictor, policy, tokenizer) with an
`EPContext`, which shards rank 0's target and wraps it in a `LeaderTarget`; the
other ranks serve target commands, loading and sharding the same checkpoint when
rank 0 does (several LLMs may be built in one job, one after another or side by side).
Launch checks run before any MPI or torch.distributed set-up and before any
weights load, so a bad launch is one line and exit code 2 on rank 0 (the other
ranks exit 2 silently).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..core.placement import ExpertPlacement, check_divides
from ..models.arch import arch_spec
from ..models.checkpoint import read_config_json
from ..models.target import TargetModel
from .dist import EPGroup, check_ep_launch, guarded, init_ep, launched_rank, launched_world_size, supervise
from .experts import shard_lean_layers, shard_target_experts
from .remote import Channel, LeaderTarget, serve_target


def num_routed_experts(target_dir) -> int:
    """Routed experts per MoE layer, read from config.json (no weights loaded)."""
    config = read_config_json(target_dir, "target checkpoint")
    arch_spec((config.get("architectures") or ["<missing 'architectures'>"])[0])  # a supported architecture
    # transformers 5 writes Qwen3-MoE's count as num_local_experts; 4.x and the Hub use num_experts.
    count = config.get("num_local_experts") or config.get("num_experts")
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"{target_dir}/config.json names no routed-expert count (num_experts / num_local_experts)")
    return count


def check_launch(ep: int | None, target_dir) -> int:
    """EP size for this launch; ValueError for --ep without mpirun, a world size that does not match,
    or an --ep that does not divide the expert count."""
    ep = check_ep_launch(ep, launched_world_size())
    if ep > 1:
        check_divides(num_routed_experts(target_dir), ep)
    return ep


def launch_ep_size(ep: int | None, model: str) -> int:
    """EP size of this launch for a CLI command (1 = one process). A bad launch raises ValueError on
    rank 0 (the CLI prints the one line, exit 2) and exits 2 quietly on the other ranks."""
    if ep is None and launched_world_size() == 1:
        return 1
    from ..resolve import resolve_model

    try:
        return check_launch(ep, resolve_model(model).target)
    except (ValueError, FileNotFoundError):
        if launched_rank() != 0:
            sys.exit(2)
        raise


def shard_target(target: TargetModel, group: EPGroup) -> ExpertPlacement:
    """Keep this rank's contiguous block of every MoE layer's experts; combine by all-reduce."""
    import torch.distributed as dist

    placement = ExpertPlacement.contiguous(len(target.moe_layers), target.num_experts, group.world_size)
    paths = [target.spec.experts_path.format(i=i) for i in target.moe_layers]
    local = [placement.local_experts(group.rank, layer) for layer in range(placement.num_layers)]
    reduce = lambda t: dist.all_reduce(t)  # noqa: E731
    shards = shard_target_experts(target.model, paths, local, reduce)
    if target.lean is not None:
        shard_lean_layers(target.lean, target.model, target.moe_layers, shards, reduce)
    return placement


@dataclass
class EPContext:
    """Rank 0's handle on the job: shards and wraps the target `LLM` loads."""

    group: EPGroup
    channel: Channel
    placement: ExpertPlacement | None = None  # set once the target is loaded
    leader: LeaderTarget | None = field(default=None, repr=False)

    def leader_target(self, target: TargetModel, path, dtype: str, model_impl: str = "lean") -> LeaderTarget:
        """Shard rank 0's freshly loaded `target` (from `path`, `dtype`, `model_impl`); every worker loads
        and shards it too."""
        self.placement = shard_target(target, self.group)
        self.leader = LeaderTarget(target, self.channel, str(path), dtype, model_impl)
        return self.leader

    def close(self) -> None:
        """Release the worker ranks (also when rank 0 failed before loading anything)."""
        self.channel.send_stop()


def run_expert_parallel(device: str, threads: int, leader_main: Callable[[EPContext], int]) -> int:
    """Run `leader_main(ctx)` on rank 0 and a target server on every other rank; returns the exit code."""
    supervise(launched_rank())  # a killed rank is reported by its supervisor (see dist.py)
    group = init_ep(device)
    torch.set_num_threads(threads)
    channel = Channel(group)
    if group.rank == 0:
        return guarded(0, lambda: _lead(EPContext(group, channel), leader_main), group)
    return guarded(group.rank, lambda: _serve(group, channel), group)


def _lead(ctx: EPContext, leader_main: Callable[[EPContext], int]) -> int:
    try:
        return leader_main(ctx)
    except (ValueError, FileNotFoundError, KeyError) as e:  # bad input found on rank 0: one line, exit 2
        print(f"moespec: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        ctx.close()


def _serve(group: EPGroup, channel: Channel) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # rank 0 owns the terminal

    def load(path: str, dtype: str, model_impl: str) -> TargetModel:
        target = TargetModel.load(path, device=group.device, dtype=dtype, model_impl=model_impl)
        shard_target(target, group)
        return target

    serve_target(load, channel)
    return 0
