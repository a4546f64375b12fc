"""The routed experts of one CPU MoE layer as one compiled call.

On CPU the torch paths of `moe.routed_experts` spend more time dispatching small operations than
moving weights: a plain decode step's four experts take ~135 us a layer on moespec-base where their
matmuls need ~40, and from two tokens on torch's grouped GEMM walks all 32 experts (~300 us a layer
for a 2-token verify). That fixed cost is not the union-of-experts cost this project selects against,
and it made a verify of one drafted node cost 0.5 plain steps. `expert_slots` computes every
(token, expert) pair in one numba-compiled loop: both projections, the gated activation and the
routing weight, reading each expert's weights in their stored layout, so only the experts the tokens
woke cost anything (measured per layer on moespec-base, 1 thread: 1 token 33 us, 2 tokens 48 us,
9 tokens 216 us, 33 tokens 487 us, against 136 / 305 / 493 / 928 us for the torch paths).

Each pair is computed by the same loops whatever the other pairs are, so a token's expert outputs do
not depend on how many tokens share the forward; the weighted slot outputs come back [N*k, H] and the
caller sums each token's k slots in slot order, as the torch paths and expert parallelism do
(`parallel/experts.py`: a rank computes its slots with this kernel too, so EP stays bitwise equal to
one process).

The dot products over a weight row are summed in a vectorised order (numba `fastmath` reassociation
only: no assumption about NaN or infinities), so results differ from the torch paths by float
rounding (~1e-7); tests/models/test_experts_host.py checks they agree. numba is optional: without it,
with MOESPEC_HOST_EXPERTS=0, with gradients enabled or for weights that are not float32 on CPU, the
torch paths run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.host_jit import compiled_kernels

SILU_GATED = 0  # Qwen3-MoE: [gate; up] halves, silu(gate) * up
CLAMPED_SWIGLU = 1  # GPT-OSS: gate/up interleaved, clamped, (up + 1) * gate * sigmoid(alpha * gate)

# Around this many (token, expert) pairs torch's grouped GEMM (BLAS over many rows per expert) catches up
# with the per-pair loops at one torch thread, the engine's default: all 24 MoE layers of moespec-base
# for 128 / 256 / 512 tokens (512 / 1024 / 2048 pairs) ran 44.6 / 84.6 / 177 ms against 58.0 / 83.8 / 198.
# Longer prompt prefills take the torch path, which more threads can speed up.
HOST_MAX_PAIRS = 1024


def compiled_experts():
    """(expert_slots,) compiled, or None when numba is missing or MOESPEC_HOST_EXPERTS=0."""
    return compiled_kernels("MOESPEC_HOST_EXPERTS", globals(), ("expert_slots",),
                            helpers=("_project_rows", "_project_cols"), fastmath={"reassoc", "contract"})


@dataclass(frozen=True)
class HostExperts:
    """One layer's expert weights as numpy views of the loaded tensors (no copy), in their stored layout."""

    gate_up: np.ndarray  # [E, 2I, H] (rows_major) or [E, H, 2I]
    gate_up_bias: np.ndarray  # [E, 2I], or [0, 0] without bias
    down: np.ndarray  # [E, H, I] (rows_major) or [E, I, H]
    down_bias: np.ndarray  # [E, H], or [0, 0]
    rows_major: bool  # weights stored [out, in] (Qwen3-MoE, transformers' layout) rather than [in, out] (GPT-OSS)
    activation: int  # SILU_GATED or CLAMPED_SWIGLU
    alpha: np.float32 = np.float32(0.0)  # the clamped SwiGLU's constants, as the kernel takes them
    limit: np.float32 = np.float32(0.0)

    @staticmethod
    def of(gate_up: torch.Tensor, gate_up_bias: torch.Tensor | None, down: torch.Tensor,
           down_bias: torch.Tensor | None, rows_major: bool, activation: int, alpha: float = 0.0,
           limit: float = 0.0) -> "HostExperts | None":
        """Views of stored (not transposed) expert weights, or None where the kernel does not apply:
        not on CPU, not float32, or not contiguous."""
        tensors = [t for t in (gate_up, gate_up_bias, down, down_bias) if t is not None]
        if any(t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
            return None

        def view(t: torch.Tensor | None) -> np.ndarray:
            return np.zeros((0, 0), np.float32) if t is None else t.detach().numpy()
        return HostExperts(view(gate_up), view(gate_up_bias), view(down), view(down_bias), rows_major, activation,
                           np.float32(alpha), np.float32(limit))


def routed_slots(x: torch.Tensor, top_ids: torch.Tensor, top_w: torch.Tensor, w: HostExperts) -> torch.Tensor | None:
    """top_w[n, j] * expert_{top_ids[n, j]}(x[n]) for x [N, H] float32 -> [N * k, H] in (token, slot)
    order; None when the kernel cannot run (no numba, or ids outside the layer's experts: the caller's
    torch path then runs and fails with torch's own error)."""
    kernels = compiled_experts()
    if kernels is None or x.dtype != torch.float32:
        return None
    N, k = top_ids.shape
    out = torch.empty(N * k, x.shape[-1], dtype=torch.float32)
    ok = kernels[0](x.detach().contiguous().numpy(), top_ids.contiguous().numpy(),
                    top_w.detach().float().contiguous().numpy(), w.gate_up, w.gate_up_bias, w.down, w.down_bias,
                    w.rows_major, w.activation, w.alpha, w.limit, out.numpy())
    return out if ok else None


def expert_slots(x, ids, weights, gate_up, gate_up_bias, down, down_bias, rows_major, activation, alpha, limit, out):
    """out [N*k, H] float32: slot (n, j) = weights[n, j] * (down(act(gate_up(x[n]) + b)) + b) for expert ids[n, j].
    Returns False (out unspecified) when a shape or an expert id is out of range.

    x [N, H] float32, ids [N, k] int64, weights [N, k] float32; weights as `HostExperts`. Pairs run grouped
    by expert (a stable sort of the ids), so an expert's weights are read once from memory and stay in
    cache for its other tokens."""
    N, k = ids.shape
    H = x.shape[1]
    E = gate_up.shape[0]
    two_i = gate_up.shape[1] if rows_major else gate_up.shape[2]
    inner = two_i // 2
    if (weights.shape[0] != N or weights.shape[1] != k or out.shape[0] != N * k or out.shape[1] != H
            or two_i != 2 * inner or down.shape[0] != E
            or (rows_major and (gate_up.shape[2] != H or down.shape[1] != H or down.shape[2] != inner))
            or (not rows_major and (gate_up.shape[1] != H or down.shape[1] != inner or down.shape[2] != H))
            or (gate_up_bias.shape[0] > 0 and (gate_up_bias.shape[0] != E or gate_up_bias.shape[1] != two_i))
            or (down_bias.shape[0] > 0 and (down_bias.shape[0] != E or down_bias.shape[1] != H))):
        return False
    flat = ids.ravel()
    for p in range(N * k):
        if flat[p] < 0 or flat[p] >= E:
            return False
    h = np.empty(two_i, np.float32)
    act = np.empty(inner, np.float32)
    o = np.empty(H, np.float32)
    for p in np.argsort(flat, kind="mergesort"):
        e = flat[p]
        n = p // k
        if rows_major:
            _project_rows(gate_up[e], x[n], h)
        else:
            _project_cols(gate_up[e], x[n], h)
        if gate_up_bias.shape[0] > 0:
            h += gate_up_bias[e]
        for i in range(inner):
            if activation == SILU_GATED:
                g = h[i]
                act[i] = g / (np.float32(1.0) + np.exp(-g)) * h[inner + i]
            else:
                g = min(h[2 * i], limit)
                u = min(max(h[2 * i + 1], -limit), limit)
                act[i] = (u + np.float32(1.0)) * (g / (np.float32(1.0) + np.exp(-g * alpha)))
        if rows_major:
            _project_rows(down[e], act, o)
        else:
            _project_cols(down[e], act, o)
        if down_bias.shape[0] > 0:
            o += down_bias[e]
        r = weights[n, p % k]
        for c in range(H):
            out[p, c] = r * o[c]
    return True


def _project_rows(w, v, out):
    """out [O] = w [O, In] @ v [In]: one dot product per contiguous row (vectorised by reassociation)."""
    for r in range(w.shape[0]):
        s = np.float32(0.0)
        for c in range(w.shape[1]):
            s += w[r, c] * v[c]
        out[r] = s


def _project_cols(w, v, out):
    """out [O] = v [In] @ w [In, O]: one scaled row added per input (vectorised along the contiguous rows)."""
    out[:] = 0.0
    for c in range(w.shape[0]):
        vc = v[c]
        for r in range(w.shape[1]):
            out[r] += vc * w[c, r]
