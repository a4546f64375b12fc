"""The pieces of the EAGLE-3 decoder layer: RMSNorm, the attention / MLP / mid-layer modules (whose
parameter names are the checkpoint's), rotary embedding, the fused inference weights and the
causal mask. `modeling.py` assembles them into `Eagle3Drafter`; `static.py` reuses `_rms`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .types import Eagle3Config


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Llama form: normalise in float32, cast back, scale); weight [H] or one row per
    stacked input [N, H]."""
    if x.dtype == torch.float32:  # torch's fused kernel: the same result, ~3 us less per call on CPU
        if weight.dim() == 1:
            return F.rms_norm(x, weight.shape, weight, eps)
        return weight * F.rms_norm(x, (x.shape[-1],), None, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.act_fn = ACT2FN[c.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)


def _rotary(c: Eagle3Config) -> nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    lc = LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
                     max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
                     rope_scaling=c.rope_scaling)
    return LlamaRotaryEmbedding(lc)


@dataclass(frozen=True)
class _FusedWeights:
    """Inference-only concatenations of the checkpoint's weights (the checkpoint's tensor names and the
    state dict are unchanged): one matmul for q/k/v, one for gate/up, one norm for both attention inputs."""

    key: tuple  # (data_ptr, version) of every source weight, to notice replacements and in-place updates
    qkv: torch.Tensor  # [(Hq + 2 * KVH) * D, 2H]
    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]
    input_norms: torch.Tensor  # [2, H] input_layernorm (embedding half), hidden_norm (hidden half)
    post_attention_norm: torch.Tensor  # [H]
    final_norm: torch.Tensor  # [H]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)



def causal_mask(past_len: int, num_new: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, T, S+T] additive causal mask for T new positions after S past ones."""
    q = torch.arange(past_len, past_len + num_new, device=device)[:, None]
    k = torch.arange(past_len + num_new, device=device)[None, :]
    mask = torch.zeros(num_new, past_len + num_new, dtype=dtype, device=device)
    mask.masked_fill_(k > q, torch.finfo(dtype).min)
    return mask[None, None]

