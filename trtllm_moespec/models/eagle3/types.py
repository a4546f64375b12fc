"""The EAGLE-3 drafter's shared types: its config (the checkpoint's config.json fields) and the
values that pass between its forward, its packed forward, the static runners and tree drafting.
The bottom layer of `models/eagle3/`: it imports nothing else from the package."""

from __future__ import annotations

from dataclasses import dataclass

import torch

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)


@dataclass(frozen=True)
class Eagle3Config:
    """The config.json fields an EAGLE-3 head uses (names as in the checkpoints)."""

    hidden_size: int  # drafter width H
    intermediate_size: int  # MLP width
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary (embedding rows, t2d length)
    draft_vocab_size: int  # lm_head rows
    target_hidden_size: int  # H_target; fc maps 3*H_target -> H
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None

    @staticmethod
    def from_dict(d: dict) -> "Eagle3Config":
        archs = d.get("architectures") or []
        if not any(a in EAGLE3_ARCHITECTURES for a in archs):
            raise ValueError(f"not an EAGLE-3 drafter config: architectures={archs}, expected {list(EAGLE3_ARCHITECTURES)}")
        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"only single-layer EAGLE-3 heads are supported, got num_hidden_layers={d['num_hidden_layers']}")
        hidden, heads = d["hidden_size"], d["num_attention_heads"]
        rope = d.get("rope_parameters") or {}
        return Eagle3Config(
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or hidden // heads,
            vocab_size=d["vocab_size"],
            draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
            target_hidden_size=d.get("target_hidden_size") or hidden,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            hidden_act=d.get("hidden_act", "silu"),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rope_theta=d.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=d.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None),
        )

    def to_dict(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": self.hidden_act, "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling, "tie_word_embeddings": False,
        }


@dataclass(frozen=True)
class Eagle3Output:
    """One drafter forward over T positions."""

    logits: torch.Tensor  # [B, T, V_draft] float32
    hidden: torch.Tensor  # [B, T, H] pre-norm output (fed back as h on the next draft step)
    keys: torch.Tensor  # [B, KVH, T, D] this forward's keys (rotary applied), for the caller to cache
    values: torch.Tensor  # [B, KVH, T, D]


@dataclass(frozen=True)
class PackedSegment:
    """One request's rows in a packed drafter forward (`Eagle3Drafter.forward_packed`)."""

    cache_kv: torch.Tensor  # [2, 1, KVH, capacity, D] the request's buffer; its rows' keys go to start..start+length
    start: int  # positions before these rows that they attend to (committed ones, then tree slots)
    length: int  # rows T_b
    attention_mask: torch.Tensor | None = None  # [1, 1, T_b, start + T_b] additive; None: causal after `start`

