"""Architecture and device presets for cost estimates (public configs and datasheets).

Model numbers come from the models' published config.json files; device numbers
are dense bf16 tensor-core peaks and HBM bandwidths from NVIDIA's datasheets.
All are overridable: construct your own MoEArchitecture / DevicePreset.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DevicePreset:
    name: str
    bandwidth_Bps: float  # HBM bytes per second
    peak_flops: float  # dense bf16 FLOP/s


@dataclass(frozen=True)
class MoEArchitecture:
    """What a cost estimate needs to know about an MoE decoder."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    vocab_size: int
    expert_bytes_per_param: float = 2.0  # bf16; GPT-OSS ships MXFP4 experts (~4.25 bits)
    sliding_window: int | None = None

    @property
    def expert_params(self) -> int:
        """Parameters of one expert (gate, up, down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def dense_params(self) -> int:
        """Attention, router and embedding/lm_head parameters (everything but experts)."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        router = self.hidden_size * self.num_experts
        return self.num_layers * (attn + router) + 2 * self.vocab_size * self.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V for one token over all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 2


DEVICES: dict[str, DevicePreset] = {
    "H200": DevicePreset("H200", 4.8e12, 989e12),
    "H100": DevicePreset("H100", 3.35e12, 989e12),
    "A100": DevicePreset("A100", 2.039e12, 312e12),
}

ARCHITECTURES: dict[str, MoEArchitecture] = {
    "qwen3-30b-a3b": MoEArchitecture("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 128, 8, 768, 151936),
    "qwen3-235b-a22b": MoEArchitecture("qwen3-235b-a22b", 94, 4096, 64, 4, 128, 128, 8, 1536, 151936),
    "gpt-oss-20b": MoEArchitecture("gpt-oss-20b", 24, 2880, 64, 8, 64, 32, 4, 2880, 201088, 4.25 / 8, 128),
    "gpt-oss-120b": MoEArchitecture("gpt-oss-120b", 36, 2880, 64, 8, 64, 128, 4, 2880, 201088, 4.25 / 8, 128),
}


def architecture(name: str) -> MoEArchitecture:
    """Look up an architecture preset by name (case-insensitive)."""
    key = name.lower()
    if key not in ARCHITECTURES:
        raise ValueError(f"unknown architecture preset {name!r}; known: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[key]
