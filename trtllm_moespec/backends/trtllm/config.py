"""Engine-directory configuration: parallel layout, verify-length profiles, TRT-LLM options.

An engine directory holds one TensorRT-LLM `extra_llm_api_options` YAML per
verify-length profile (TensorRT-LLM captures CUDA graphs per (batch size, draft
length) and a config has one `max_total_draft_tokens`), the main YAML (the
largest profile), and `moespec.json`, described by `EngineSpec`.

Draft modes:
- "tree": TensorRT-LLM's EAGLE-3 dynamic tree (Eagle3OneModelDynamicTreeWorker);
  our selection replaces its final top-N pruning. Profile v verifies v nodes with
  max_draft_len = min(steps, v) (TensorRT-LLM needs max_draft_len <= v <= topK*max_draft_len).
- "chain": models with sliding-window attention (GPT-OSS), which TensorRT-LLM's
  dynamic tree does not support. A linear EAGLE-3 draft of length v per profile;
  our selection picks the verified prefix length (EVICT on a chain).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from .presets import ModelPreset, TreeDefaults
from .schema import EAGLE3_DECODING_TYPE, validate_llm_api_options

MOESPEC_JSON = "moespec.json"
MAIN_OPTIONS_YAML = "llm_api_options.yaml"
PROFILES_DIR = "profiles"
COST_PROFILE_JSON = "cost_profile.json"
ENGINE_FORMAT_VERSION = 1
POLICIES = ("ar", "eagle3", "evict", "ecospec", "joint", "coverage", "ddd")


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1  # tensor_parallel_size
    pp: int = 1  # pipeline_parallel_size
    ep: int = 1  # moe_expert_parallel_size
    moe_tp: int = 1  # moe_tensor_parallel_size = tp // ep

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


def check_parallel(tp: int, pp: int, ep: int, num_experts: int) -> ParallelConfig:
    """Validate a TP x PP x EP layout as TensorRT-LLM's Mapping would; ValueError if not.

    The MoE grid fills the tensor-parallel group (moe_tp * ep == tp), so ep must
    divide tp; every EP rank holds whole experts, so ep must divide num_experts.
    """
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value!r}")
    if tp % ep != 0:
        raise ValueError(f"--ep {ep} must divide --tp {tp} (TensorRT-LLM needs moe_tp * ep == tp)")
    if num_experts % ep != 0:
        raise ValueError(f"--ep {ep} must divide the model's {num_experts} experts")
    return ParallelConfig(tp=tp, pp=pp, ep=ep, moe_tp=tp // ep)


def check_tree(tree: TreeDefaults) -> TreeDefaults:
    if tree.steps < 1 or tree.topk < 1 or tree.max_draft_tokens < 1:
        raise ValueError(f"tree steps/topk/max_draft_tokens must be positive, got {tree}")
    if tree.max_draft_tokens > tree.steps * tree.topk:
        raise ValueError(
            f"max_draft_tokens={tree.max_draft_tokens} exceeds steps*topk={tree.steps * tree.topk}, "
            "the most TensorRT-LLM's dynamic tree can verify"
        )
    return tree


def parse_verify_lengths(value: str | Iterable[int] | None, max_draft_tokens: int) -> tuple[int, ...]:
    """'4,8,16,32' -> (4, 8, 16, 32); None -> (max_draft_tokens,). Sorted, deduplicated.

    Raises ValueError for non-integers, values < 1, or values above max_draft_tokens.
    """
    if value is None:
        return (max_draft_tokens,)
    items = value.split(",") if isinstance(value, str) else list(value)
    lengths = []
    for item in items:
        try:
            v = int(str(item).strip())
        except ValueError:
            raise ValueError(f"verify length {item!r} is not an integer") from None
        if v < 1:
            raise ValueError(f"verify lengths must be positive, got {v}")
        if v > max_draft_tokens:
            raise ValueError(f"verify length {v} exceeds the tree's max_draft_tokens={max_draft_tokens}")
        lengths.append(v)
    if not lengths:
        raise ValueError("no verify lengths given")
    return tuple(sorted(set(lengths)))


def draft_mode(preset: ModelPreset, tree: TreeDefaults | None = None, trtllm_line: str = "dynamic-tree") -> str:
    """'chain' or 'tree' (version.py has the policy).

    chain: sliding-window models (TRT-LLM's dynamic tree lacks them), the 1.2 line
    (no dynamic tree there) and topk 1 (main routes dynamic_tree_max_topK < 2 to the
    linear worker, `_is_effective_dynamic_tree`); else tree.
    """
    if preset.has_sliding_window or trtllm_line == "1.2" or (tree is not None and tree.topk < 2):
        return "chain"
    return "tree"


def cuda_graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Powers of two below max_batch_size, then max_batch_size itself."""
    if max_batch_size < 1:
        raise ValueError(f"--max-batch-size must be positive, got {max_batch_size}")
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch_size]


@dataclass(frozen=True)
class VerifyProfile:
    verify_length: int  # draft nodes verified per step (TRT-LLM max_total_draft_tokens)
    max_draft_len: int  # drafting steps (tree depth or chain length)
    options_yaml: str  # path of its extra_llm_api_options, relative to the engine dir


def make_profiles(lengths: tuple[int, ...], tree: TreeDefaults, mode: str) -> tuple[VerifyProfile, ...]:
    profiles = []
    for v in lengths:
        depth = v if mode == "chain" else min(tree.steps, v)
        profiles.append(VerifyProfile(v, depth, f"{PROFILES_DIR}/verify_{v}.yaml"))
    return tuple(profiles)


def speculative_config(
    preset: ModelPreset, tree: TreeDefaults, profile: VerifyProfile, draft_dir: str, mode: str
) -> dict[str, Any]:
    """TensorRT-LLM Eagle3 speculative_config for one profile."""
    spec: dict[str, Any] = {
        "decoding_type": EAGLE3_DECODING_TYPE,
        "speculative_model_dir": draft_dir,
        "eagle3_one_model": True,
        "max_draft_len": profile.max_draft_len,
        "max_total_draft_tokens": profile.verify_length,
        "eagle3_layers_to_capture": preset.trtllm_layers_to_capture,
    }
    if mode == "tree":
        # Exact-match verification for sampled requests (the default in llm_args.py @
        # 0004396720054fd8e205cbf616f21f0b57c6b412): the MoESpec worker's copies (padding.py) are never accepted
        # there, but would be by the dynamic-tree rejection kernel.
        spec.update(use_dynamic_tree=True, dynamic_tree_max_topK=tree.topk, use_rejection_sampling=False)
    else:
        spec.update(use_dynamic_tree=False)
    return spec


def llm_api_options(
    preset: ModelPreset,
    tree: TreeDefaults,
    parallel: ParallelConfig,
    profile: VerifyProfile,
    *,
    draft_dir: str,
    mode: str,
    max_batch_size: int,
    max_seq_len: int | None = None,
    free_gpu_memory_fraction: float = 0.85,
    cuda_graphs: bool = True,
    moe_backend: str | None = None,
) -> dict[str, Any]:
    """One extra_llm_api_options mapping, validated against schema.py.

    cuda_graphs=False writes `cuda_graph_config: null` (policies that select eagerly); moe_backend sets
    `moe_config.backend` (None: TensorRT-LLM's default).
    """
    graph_sizes = cuda_graph_batch_sizes(max_batch_size)
    graphs = {"batch_sizes": graph_sizes, "max_batch_size": max(graph_sizes), "enable_padding": True}
    options: dict[str, Any] = {
        "backend": "pytorch",
        "dtype": preset.dtype,
        "tensor_parallel_size": parallel.tp,
        "pipeline_parallel_size": parallel.pp,
        "moe_expert_parallel_size": parallel.ep,
        "moe_tensor_parallel_size": parallel.moe_tp,
        "max_batch_size": max_batch_size,
        "kv_cache_config": {"free_gpu_memory_fraction": free_gpu_memory_fraction},
        "cuda_graph_config": graphs if cuda_graphs else None,
        "speculative_config": speculative_config(preset, tree, profile, draft_dir, mode),
    }
    if max_seq_len is not None:
        options["max_seq_len"] = max_seq_len
    if moe_backend is not None:
        options["moe_config"] = {"backend": moe_backend}
    validate_llm_api_options(options)
    return options


def with_batch_contract(options: dict[str, Any], contract: str) -> dict[str, Any]:
    """The options a dynamic-tree worker of `contract` (worker.BATCH_CONTRACTS) can be built from.

    'public': its constructor reads speculative_config.max_batch_size and raises without it, so the
    engine's max_batch_size is copied there; 'private': TensorRT-LLM fills it, the options stay as
    they are (a public field would be an unknown key there).
    """
    if contract == "private":
        return options
    if contract != "public":
        raise ValueError(f"unknown batch-size contract {contract!r}")
    spec = dict(options["speculative_config"], max_batch_size=options["max_batch_size"])
    return {**options, "speculative_config": spec}


@dataclass(frozen=True)
class EngineSpec:
    """What moespec.json records about an engine directory."""

    model: ModelPreset  # the target's architecture facts
    checkpoint: str | None  # absolute path of the target checkpoint (None: dry run without one)
    draft_model: str  # absolute path of the EAGLE-3 drafter
    policy: str
    mode: str  # "tree" | "chain"
    tree: TreeDefaults  # steps, topk, max_draft_tokens
    parallel: ParallelConfig
    max_batch_size: int
    profiles: tuple[VerifyProfile, ...]  # ascending verify length
    llm_api_options: str  # main YAML, relative to the engine dir
    cost_profile: str | None  # relative path, None until profiled on a GPU
    predictor: str | None  # absolute path of an expert predictor, if any
    dtype: str
    versions: dict[str, str | None]  # trtllm_moespec, tensorrt_llm_range, tensorrt_llm (None if not used)
    dry_run: bool
    max_seq_len: int | None = None
    moe_backend: str | None = None  # moe_config.backend, None = TensorRT-LLM's default
    format_version: int = ENGINE_FORMAT_VERSION

    def profile(self, verify_length: int) -> VerifyProfile:
        for p in self.profiles:
            if p.verify_length == verify_length:
                return p
        raise ValueError(f"no profile with verify length {verify_length}; have {[p.verify_length for p in self.profiles]}")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["model"] = self.model.to_json()
        d["profiles"] = [asdict(p) for p in self.profiles]
        return d

    @staticmethod
    def from_json(data: dict[str, Any]) -> "EngineSpec":
        if data.get("format_version") != ENGINE_FORMAT_VERSION:
            raise ValueError(f"moespec.json format_version {data.get('format_version')!r} is not {ENGINE_FORMAT_VERSION}")
        known = set(EngineSpec.__dataclass_fields__)
        missing = known - set(data) - {"max_seq_len", "moe_backend"}
        if missing:
            raise ValueError(f"moespec.json lacks {sorted(missing)}")
        fields = {k: v for k, v in data.items() if k in known}
        fields.update(
            model=ModelPreset.from_json(data["model"]),
            tree=TreeDefaults(**data["tree"]),
            parallel=ParallelConfig(**data["parallel"]),
            profiles=tuple(VerifyProfile(**p) for p in data["profiles"]),
        )
        return EngineSpec(**fields)


def load_engine_spec(engine_dir: str | Path) -> EngineSpec:
    """Read `moespec.json` of an engine directory (FileNotFoundError / ValueError on problems)."""
    path = Path(engine_dir) / MOESPEC_JSON
    if not path.is_file():
        raise FileNotFoundError(f"{engine_dir} has no {MOESPEC_JSON}; build it with `moespec build` first")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return EngineSpec.from_json(data)
