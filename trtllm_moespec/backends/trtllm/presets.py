"""Model presets for engine builds: architecture facts, EAGLE-3 capture layers, defaults.

The four presets carry the public `config.json` facts of the paper checkpoints
(Qwen/Qwen3-30B-A3B-Instruct-2507, Qwen/Qwen3-235B-A22B-Instruct-2507,
openai/gpt-oss-20b, openai/gpt-oss-120b). Any local Hugging Face directory works
too: its `config.json` is read; nothing is ever downloaded.

EAGLE-3 capture layers follow SGLang: the hidden states entering layers
(2, L//2, L-3). TensorRT-LLM names the same tensors by the layer that *produces*
them, (1, L//2-1, L-4), which is also its default `eagle3_layers_to_capture`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...core.presets import architecture as core_architecture

# The EVICT paper's tree: 4 drafting steps, top-8 per step, 32 verified draft tokens.
DEFAULT_TREE_STEPS = 4
DEFAULT_TREE_TOPK = 8
DEFAULT_MAX_DRAFT_TOKENS = 32

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM", "GptOssForCausalLM")


@dataclass(frozen=True)
class TreeDefaults:
    steps: int = DEFAULT_TREE_STEPS  # drafting steps = tree depth (TRT-LLM max_draft_len)
    topk: int = DEFAULT_TREE_TOPK  # children kept per step (TRT-LLM dynamic_tree_max_topK)
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS  # largest verified node count


@dataclass(frozen=True)
class ModelPreset:
    """Architecture facts of one MoE target and how we recommend serving it."""

    name: str  # preset name or the local directory it was read from
    architecture: str  # Hugging Face architectures[0]
    hf_id: str | None  # checkpoint id on the Hub (informational; never downloaded)
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    experts_per_token: int  # router top-k
    moe_intermediate_size: int
    vocab_size: int
    sliding_window: int | None = None  # GPT-OSS: window of its sliding-attention layers
    recommended_tp: int = 1
    recommended_ep: int = 1
    dtype: str = "bfloat16"
    suggested_draft: str | None = None  # an EAGLE-3 drafter known to fit (informational)
    tree: TreeDefaults = field(default_factory=TreeDefaults)

    @property
    def has_sliding_window(self) -> bool:
        return self.sliding_window is not None

    @property
    def eagle3_capture_layers(self) -> tuple[int, int, int]:
        """Layers whose *inputs* the drafter reads (SGLang convention): (2, L//2, L-3)."""
        L = self.num_layers
        return (2, L // 2, L - 3)

    @property
    def trtllm_layers_to_capture(self) -> list[int]:
        """The same hidden states named by their producing layer (TRT-LLM convention)."""
        return [i - 1 for i in self.eagle3_capture_layers]

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "tree"}
        d["tree"] = {"steps": self.tree.steps, "topk": self.tree.topk, "max_draft_tokens": self.tree.max_draft_tokens}
        d["eagle3_capture_layers"] = list(self.eagle3_capture_layers)
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> "ModelPreset":
        """Inverse of to_json (derived keys are ignored)."""
        fields = {k: v for k, v in d.items() if k in ModelPreset.__dataclass_fields__ and k != "tree"}
        tree = TreeDefaults(**d["tree"]) if "tree" in d else TreeDefaults()
        return ModelPreset(**fields, tree=tree)


def _preset(name: str, architecture: str, hf_id: str, tp: int, ep: int, draft: str | None = None) -> ModelPreset:
    """A serving preset on top of the core's architecture facts (one source of model numbers)."""
    a = core_architecture(name)
    return ModelPreset(
        name=name, architecture=architecture, hf_id=hf_id, num_layers=a.num_layers, hidden_size=a.hidden_size,
        num_attention_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
        num_experts=a.num_experts, experts_per_token=a.top_k, moe_intermediate_size=a.moe_intermediate_size,
        vocab_size=a.vocab_size, sliding_window=a.sliding_window, recommended_tp=tp, recommended_ep=ep,
        suggested_draft=draft,
    )


PRESETS: dict[str, ModelPreset] = {
    # ~61 GB of bf16 weights: one H100/H200
    "qwen3-30b-a3b": _preset("qwen3-30b-a3b", "Qwen3MoeForCausalLM", "Qwen/Qwen3-30B-A3B-Instruct-2507", 1, 1,
                             "lmsys/SGLang-EAGLE3-Qwen3-30B-A3B-Instruct-2507-SpecForge-Nex"),
    # ~470 GB of bf16 weights: 8 GPUs, experts sharded by EP
    "qwen3-235b-a22b": _preset("qwen3-235b-a22b", "Qwen3MoeForCausalLM", "Qwen/Qwen3-235B-A22B-Instruct-2507", 8, 8,
                               "lmsys/SGLang-EAGLE3-Qwen3-235B-A22B-Instruct-2507-SpecForge-Meituan"),
    "gpt-oss-20b": _preset("gpt-oss-20b", "GptOssForCausalLM", "openai/gpt-oss-20b", 1, 1),
    # MXFP4 experts fit one 80 GB GPU; EP spreads experts when tp > 1
    "gpt-oss-120b": _preset("gpt-oss-120b", "GptOssForCausalLM", "openai/gpt-oss-120b", 1, 1),
}


def _require(cfg: dict[str, Any], key: str, path: Path) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{path} has no {key!r}; cannot derive the model's architecture facts")
    return cfg[key]


def preset_from_hf_config(cfg: dict[str, Any], source: Path) -> ModelPreset:
    """Build a preset from a Hugging Face config.json dict (Qwen3-MoE or GPT-OSS)."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{source}: architecture {arch!r} is not supported; expected one of {SUPPORTED_ARCHITECTURES}")
    heads = int(_require(cfg, "num_attention_heads", source))
    hidden = int(_require(cfg, "hidden_size", source))
    # transformers 5.x writes Qwen3-MoE's expert count as num_local_experts; 4.x and the Hub use num_experts.
    num_experts = int(cfg.get("num_local_experts") or _require(cfg, "num_experts", source))
    if arch == "GptOssForCausalLM":
        top_k = int(cfg.get("num_experts_per_tok") or _require(cfg, "experts_per_token", source))
        moe_inter = int(_require(cfg, "intermediate_size", source))
        window = cfg.get("sliding_window")
    else:
        top_k = int(_require(cfg, "num_experts_per_tok", source))
        moe_inter = int(_require(cfg, "moe_intermediate_size", source))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    return ModelPreset(
        name=str(source),
        architecture=arch,
        hf_id=None,
        num_layers=int(_require(cfg, "num_hidden_layers", source)),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        num_experts=num_experts,
        experts_per_token=top_k,
        moe_intermediate_size=moe_inter,
        vocab_size=int(_require(cfg, "vocab_size", source)),
        sliding_window=int(window) if window else None,
    )


def load_hf_config(directory: str | Path) -> dict[str, Any]:
    """Read `config.json` of a local checkpoint directory (FileNotFoundError if absent)."""
    from ...models.checkpoint import read_config_json

    return read_config_json(directory, "checkpoint")


def resolve_model(model: str) -> ModelPreset:
    """A preset by name, or a preset read from a local Hugging Face directory."""
    if model in PRESETS:
        return PRESETS[model]
    if Path(model).exists() or "/" in model or model.startswith("."):
        path = Path(model)
        return preset_from_hf_config(load_hf_config(path), path)
    raise ValueError(f"unknown model preset {model!r}; choose one of {sorted(PRESETS)} or give a local HF directory")


def check_checkpoint_matches(preset: ModelPreset, checkpoint: str | Path) -> ModelPreset:
    """Read the checkpoint's config.json and check it is the preset's model; returns the preset.

    Raises ValueError when layer/expert counts disagree (a wrong directory).
    """
    found = preset_from_hf_config(load_hf_config(checkpoint), Path(checkpoint))
    for key in ("architecture", "num_layers", "hidden_size", "num_experts", "experts_per_token"):
        if getattr(found, key) != getattr(preset, key):
            raise ValueError(
                f"checkpoint {checkpoint} does not match preset {preset.name}: {key} = {getattr(found, key)} "
                f"(preset says {getattr(preset, key)})"
            )
    return preset
