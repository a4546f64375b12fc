"""Architecture facts for the supported MoE targets, in one small table.

Adding another Hugging Face MoE architecture is one `ArchSpec` entry: where its
decoder layers and routers live, which attention implementation it needs, and
how its sliding-window layers are described. Everything else (tree masks,
captures, KV compaction) is generic and lives in `target.py`.

Facts verified on transformers 5.24 (and the 4.57 layouts noted inline):
- Qwen3-MoE: router `model.layers.{i}.mlp.gate`. 5.x: `Qwen3MoeTopKRouter`
  returns `(router_logits, topk_weights, topk_index)`; 4.57: a plain `nn.Linear`
  returning logits, so top-k ids are `topk(softmax(logits), num_experts_per_tok)`
  (= top-k of the logits). Dense layers (`mlp_only_layers`, `decoder_sparse_step`)
  have no `gate` and are skipped. Sliding window (if `use_sliding_window`) applies
  to every layer; `config.sliding_window` is None otherwise.
- GPT-OSS: router `model.layers.{i}.mlp.router` returning
  `(router_logits, router_scores, router_indices)` (4.57: `(scores, indices)`).
  Attention sinks need eager attention; `config.layer_types[i]` is
  `"sliding_attention"` or `"full_attention"`, and `GptOssModel.forward` takes a
  precomputed mask dict keyed by those names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ArchSpec:
    """How to adapt one Hugging Face MoE architecture (one row of the table)."""

    name: str  # config.architectures[0]
    layers_path: str  # module path of the decoder-layer ModuleList
    router_path: str  # module path of layer i's router, `{i}` = layer index
    attn_implementation: str | None  # forced attention implementation (None = transformers default)
    mask_by_layer_type: bool  # True: the model takes {"full_attention": m, "sliding_attention": m_sw}
    num_experts_attr: str  # config attribute holding the routed-expert count
    experts_path: str = "model.layers.{i}.mlp.experts"  # layer i's stacked experts module (sharded under EP)


ARCHITECTURES: dict[str, ArchSpec] = {
    "Qwen3MoeForCausalLM": ArchSpec(
        name="Qwen3MoeForCausalLM",
        layers_path="model.layers",
        router_path="model.layers.{i}.mlp.gate",
        attn_implementation="sdpa",
        mask_by_layer_type=False,
        num_experts_attr="num_experts",
    ),
    "GptOssForCausalLM": ArchSpec(
        name="GptOssForCausalLM",
        layers_path="model.layers",
        router_path="model.layers.{i}.mlp.router",
        attn_implementation="eager",  # attention sinks: only the eager path is exact on CPU
        mask_by_layer_type=True,
        num_experts_attr="num_local_experts",
    ),
}


def arch_spec(architecture: str) -> ArchSpec:
    """The table row for `architecture`; ValueError listing the supported ones otherwise."""
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"unsupported target architecture {architecture!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[architecture]


def default_capture_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3 capture layers as in SGLang: the inputs of layers 2, L//2 and L-3.

    Clamped into [0, L-1] so tiny test models (L < 5) still get three valid layers.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))  # type: ignore[return-value]


def layer_types(config, num_layers: int) -> tuple[str, ...]:
    """Per-layer attention type: `config.layer_types` if present, else derived from `sliding_window`."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return tuple(types)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    return (kind,) * num_layers


def router_topk_ids(output, top_k: int) -> torch.Tensor:
    """Top-k expert ids [num_tokens, top_k] int64 from a router module's forward output.

    Handles routers that return `(logits, weights, index)` (transformers 5.x), `(scores, index)`
    (GPT-OSS on 4.57), or plain logits (the 4.57 Qwen3-MoE gate, an nn.Linear): softmax is
    monotone, so the top-k of the logits is the top-k of the routing probabilities.
    """
    if isinstance(output, (tuple, list)):
        last = output[-1]
        if isinstance(last, torch.Tensor) and not last.is_floating_point():
            return last.reshape(-1, last.shape[-1]).long()
        output = output[0]
    logits = output.reshape(-1, output.shape[-1])
    return logits.topk(top_k, dim=-1).indices
