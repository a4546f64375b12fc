"""Training features of the EAGLE-3 drafter and of the draft-head expert predictor.

`target_features` runs the frozen target over a batch of windows exactly as the
engine does (`TargetModel`'s own forward with its capture hooks), so the drafter
and the head see the same three captured hidden states and the same router top-K
ids as at inference.

`ttt_unroll` is EAGLE-3's training-time test. Drafter position t holds the token
x_{t+1} and predicts x_{t+2}. Step 0 feeds fc(target hidden at t); step k >= 1
feeds, at position t, the drafter's own pre-norm output of step k-1 at position
t-1 (the hidden that proposed x_{t+1} along a draft chain that started at the
committed position t-k), with rotary position t — as `eagle3_draft.py` feeds a
depth-k tree node. Its query attends to the step-0 keys of positions <= t-k (the
committed prefix) and to the step-j keys of position t-k+j for j = 1..k (its
drafted ancestors and itself), which is the tree mask of inference restricted to a
chain. Step k is meaningful for t >= k only (`ttt_valid`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.eagle3 import Eagle3Drafter, Eagle3Output, causal_mask
from ..models.target import TargetModel


@dataclass(frozen=True)
class TargetFeatures:
    """The frozen target's outputs over a batch of windows."""

    hidden: torch.Tensor  # [B, T, 3*H] float32 inputs of the three capture layers
    logits: torch.Tensor  # [B, T, V] float32 next-token logits
    expert_ids: torch.Tensor  # [B, T, L, K] int64 router top-K expert ids


@torch.no_grad()
def target_features(target: TargetModel, input_ids: torch.Tensor) -> TargetFeatures:
    """One causal target forward over input_ids [B, T] (no KV kept between calls)."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [B, T>0], got {tuple(input_ids.shape)}")
    out = target.forward_windows(input_ids)
    return TargetFeatures(out.hidden.float(), out.logits.float(), out.expert_ids.long())


def ttt_mask(seq_len: int, step: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, T, (step+1)*T] additive mask of TTT step `step` >= 1 over the keys of steps 0..step."""
    t = torch.arange(seq_len, device=device)[:, None]
    s = torch.arange(seq_len, device=device)[None, :]
    blocks = [s <= t - step] + [s == t - step + j for j in range(1, step + 1)]
    allowed = torch.cat(blocks, dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def ttt_valid(seq_len: int, step: int, device=None) -> torch.Tensor:
    """[T] bool: positions whose step-`step` draft chain starts inside the window (t >= step)."""
    return torch.arange(seq_len, device=device) >= step


def ttt_unroll(drafter: Eagle3Drafter, target_hidden: torch.Tensor, token_ids: torch.Tensor,
               num_steps: int) -> list[Eagle3Output]:
    """Run steps 0..num_steps-1 of the training-time test.

    target_hidden [B, T, 3*H_target]: target features at positions 0..T-1; token_ids [B, T]:
    x_1..x_T (the token after each position). Returns one Eagle3Output per step; step k's
    logits at position t score x_{t+2} after a chain of k drafter steps.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if target_hidden.shape[:2] != token_ids.shape:
        raise ValueError(f"target_hidden {tuple(target_hidden.shape)} and token_ids {tuple(token_ids.shape)} "
                         "must share [B, T]")
    B, T = token_ids.shape
    device, dtype = target_hidden.device, drafter.fc.weight.dtype
    positions = torch.arange(T, device=device)[None].expand(B, T)
    embeds = drafter.embed_tokens(token_ids)
    outs = [drafter(target_hidden, inputs_embeds=embeds, position_ids=positions,
                    attention_mask=causal_mask(0, T, dtype, device))]
    keys, values = [outs[0].keys], [outs[0].values]
    for step in range(1, num_steps):
        prev = outs[-1].hidden
        shifted = torch.cat([prev.new_zeros(B, 1, prev.shape[-1]), prev[:, :-1]], dim=1)
        out = drafter(shifted, inputs_embeds=embeds, position_ids=positions,
                      attention_mask=ttt_mask(T, step, dtype, device),
                      past_kv=(torch.cat(keys, dim=2), torch.cat(values, dim=2)))
        keys.append(out.keys)
        values.append(out.values)
        outs.append(out)
    return outs
