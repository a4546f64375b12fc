"""The ``moespec-tiny`` target: a small ``Qwen3MoeForCausalLM`` (every layer MoE).

Sized so that training fits ~1 hour on 2 CPU cores, the fp16 weights stay far
below the 48 MB package budget, and verifying 32 tokens costs >= 2x one token
with transformers' default ``grouped_mm`` experts (see ``cost_probe``).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Qwen3MoeConfig


@dataclass(frozen=True)
class TargetShape:
    """Architecture knobs of a target family (defaults: moespec-tiny)."""

    vocab_size: int = 4096
    hidden_size: int = 256  # model width
    num_hidden_layers: int = 4  # every layer is a sparse MoE block
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_experts: int = 32
    num_experts_per_tok: int = 4  # top-K routing
    moe_intermediate_size: int = 128  # per-expert FFN width
    max_position_embeddings: int = 2048
    router_aux_loss_coef: float = 0.03  # Switch load-balancing loss weight
    tie_word_embeddings: bool = True


FAMILIES = {
    # the fast model of the test suite: a drafter forward is ~22% of a plain step
    "tiny": TargetShape(),
    # the deployment regime (a drafter forward ~1/10 of a plain step, as for Qwen3-30B-A3B /
    # GPT-OSS, where it is ~1/30): depth and experts, not width; 43.7M parameters, 87 MB in fp16
    "base": TargetShape(num_hidden_layers=24, moe_intermediate_size=64),
}


def make_config(shape: TargetShape, eos_token_id: int = 0) -> Qwen3MoeConfig:
    """The Hugging Face config of ``shape``; the end-of-text id is bos/eos/pad."""
    return Qwen3MoeConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=4 * shape.hidden_size,  # unused: no dense MLP layers
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        moe_intermediate_size=shape.moe_intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        router_aux_loss_coef=shape.router_aux_loss_coef,
        output_router_logits=False,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        use_cache=True,
    )


def parse_layers(spec: str) -> tuple[int, ...]:
    """Decoder layer indices from "2-5,8,10-11" (ranges inclusive); "" -> ()."""
    layers: list[int] = []
    for part in filter(None, spec.split(",")):
        first, _, last = part.partition("-")
        try:
            layers += range(int(first), int(last or first) + 1)
        except ValueError:
            raise ValueError(f"{part!r} is not a layer index or a range like 2-5") from None
    return tuple(layers)
