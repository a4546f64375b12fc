"""Warm starts of a target run from an exported model.

Two cases, picked by the shapes:

- **same shape** (a later training segment that starts from the shipped, exported
  model on a fresh machine): the weights are copied as they are;
- **depth and expert up-scaling** (``moespec-base`` from ``moespec-tiny``): every source
  layer ``j`` becomes ``r = L_dst / L_src`` consecutive layers. The first two hold the
  source layer split along the experts' intermediate neurons: a SwiGLU expert is a sum
  over its neurons, so ``E(x) = E_a(x) + E_b(x)`` with ``E_a`` / ``E_b`` the first and
  second half; both copies keep the source router, so the pair computes the source
  layer's MoE (the second half sees the residual after the first, the only
  approximation), and only the first keeps the attention output. The other ``r - 2``
  layers are fresh (random init) with their output projections (``o_proj``, the
  experts' ``down_proj``) at zero, so they start as identities and every one of their
  weights is trained from the first step on (block expansion, as in LLaMA-Pro).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3MoeForCausalLM

# Parameters a layer copies from its source layer unchanged.
_SHARED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.q_norm.weight",
           "self_attn.k_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate.weight")
_SHAPE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok", "vocab_size")


def warm_start(model: Qwen3MoeForCausalLM, source_dir: Path) -> str:
    """Initialise ``model`` from the exported target in ``source_dir``; returns "copy" or "upscale"."""
    source = Qwen3MoeForCausalLM.from_pretrained(source_dir, dtype=torch.float32)
    dst, src = model.config, source.config
    mismatched = [k for k in _SHAPE_KEYS if getattr(dst, k) != getattr(src, k)]
    if mismatched:
        raise ValueError(f"cannot warm-start from {source_dir}: {', '.join(f'{k} {getattr(src, k)} != {getattr(dst, k)}' for k in mismatched)}")
    if (dst.num_hidden_layers, dst.moe_intermediate_size) == (src.num_hidden_layers, src.moe_intermediate_size):
        model.load_state_dict(source.state_dict(), strict=False)
        model.tie_weights()
        return "copy"
    upscale(model, source)
    return "upscale"


@torch.no_grad()
def upscale(model: Qwen3MoeForCausalLM, source: Qwen3MoeForCausalLM) -> None:
    """Depth and expert up-scaling of ``source`` into ``model`` (module docstring)."""
    l_dst, l_src = model.config.num_hidden_layers, source.config.num_hidden_layers
    i_dst, i_src = model.config.moe_intermediate_size, source.config.moe_intermediate_size
    if l_dst % l_src or l_dst // l_src < 2 or i_src != 2 * i_dst:
        raise ValueError(f"up-scaling needs layers {l_dst} = r x {l_src} (r >= 2) and moe_intermediate {i_src} = 2 x {i_dst}")
    ratio = l_dst // l_src
    model.model.embed_tokens.weight.copy_(source.model.embed_tokens.weight)
    model.model.norm.weight.copy_(source.model.norm.weight)
    for j, src_layer in enumerate(source.model.layers):
        src_params = dict(src_layer.named_parameters())
        for c in range(ratio):
            layer = model.model.layers[j * ratio + c]
            params = dict(layer.named_parameters())
            if c < 2:
                for name in _SHARED:
                    params[name].copy_(src_params[name])
                _copy_expert_half(layer.mlp.experts, src_layer.mlp.experts, half=c)
                if c == 0:
                    params["self_attn.o_proj.weight"].copy_(src_params["self_attn.o_proj.weight"])
                else:
                    params["self_attn.o_proj.weight"].zero_()
            else:
                params["self_attn.o_proj.weight"].zero_()
                layer.mlp.experts.down_proj.zero_()
    model.tie_weights()


def _copy_expert_half(dst: torch.nn.Module, src: torch.nn.Module, half: int) -> None:
    """``dst``'s experts = neurons ``[half * I, (half + 1) * I)`` of ``src``'s (I = dst's width)."""
    width, src_width = dst.down_proj.shape[-1], src.down_proj.shape[-1]
    rows = slice(half * width, (half + 1) * width)
    dst.gate_up_proj[:, :width].copy_(src.gate_up_proj[:, rows])  # gate rows
    dst.gate_up_proj[:, width:].copy_(src.gate_up_proj[:, src_width:][:, rows])  # up rows
    dst.down_proj.copy_(src.down_proj[:, :, rows])
