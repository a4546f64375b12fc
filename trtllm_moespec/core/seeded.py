"""Counter-based randomness for seeded requests: the uniform of output position t is a hash of
(key, t) alone, so a seeded request draws the same number for its t-th output token whichever tree,
policy, batch or goodput-guard decision brought it there. The acceptance rule that uses these
numbers (sample each position's target token, accept the child equal to it) is in verify.py.

The hash is SplitMix64's output function (Steele, Lea and Flood, "Fast splittable pseudorandom
number generators", OOPSLA 2014): U(key, t) is the (t+1)-th output of SplitMix64 started from
mix(key). SplitMix64 is counter-based by construction (output i is mix(state0 + i * gamma)), so
any position costs a few integer operations and nothing is carried from one position to the next;
its sequences pass BigCrush. Mixing the key first keeps the streams of nearby seeds (s, s + 1, the
seeds of a request's n completions) unrelated.

Each uniform has 24 random bits: exact in float32, the arithmetic of the inverse-CDF sampler
(sampling.sample_from_probs), and never 1.0. A token's probability is thereby resolved to 2^-24,
as with the unseeded rule's uniforms, which are also compared in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2^64 / the golden ratio, odd
UNIFORM_BITS = 24


def _mix64(z: int) -> int:
    """SplitMix64's finaliser (a variant of MurmurHash3's fmix64): a bijection on 64-bit integers."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def position_uniform(key: int, position: int) -> float:
    """U(key, position) in [0, 1), a multiple of 2^-24: the uniform of output position `position`."""
    z = _mix64((_mix64(key) + (position + 1) * GOLDEN_GAMMA) & MASK64)
    return (z >> (64 - UNIFORM_BITS)) / float(1 << UNIFORM_BITS)


@dataclass(frozen=True)
class PositionKeys:
    """The seeded requests of one verify call: each one's key and where its output stands."""

    keys: tuple[int, ...]  # [B] each request's key (its seed), 0 <= key < 2^64
    starts: tuple[int, ...]  # [B] output position of the token sampled at its root (tokens output so far)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.starts):
            raise ValueError(f"need one start per key: got {len(self.starts)} starts for {len(self.keys)} keys")
        for key in self.keys:
            if not (isinstance(key, int) and 0 <= key <= MASK64):
                raise ValueError(f"a sampling key must be an integer in [0, 2^64), got {key!r}")
        for start in self.starts:
            if not (isinstance(start, int) and start >= 0):
                raise ValueError(f"an output position must be an integer >= 0, got {start!r}")

    def uniforms(self, max_depth: int) -> torch.Tensor:
        """[B, max_depth + 1] float32: row b, column d is U(keys[b], starts[b] + d), the uniform of the
        token sampled at a depth-d node (the root's at d = 0). position_uniform's arithmetic on numpy
        uint64 arrays (whose products wrap modulo 2^64), for every request at once."""
        with np.errstate(over="ignore"):
            keys = _mix64_array(np.array(self.keys, dtype=np.uint64))[:, None]  # [B, 1]
            counters = np.array(self.starts, dtype=np.uint64)[:, None] + np.arange(1, max_depth + 2, dtype=np.uint64)
            z = _mix64_array(keys + counters * np.uint64(GOLDEN_GAMMA))  # [B, D+1]
        bits = (z >> np.uint64(64 - UNIFORM_BITS)).astype(np.float32)  # < 2^24: exact
        return torch.from_numpy(bits / np.float32(1 << UNIFORM_BITS)).reshape(len(self.keys), max_depth + 1)


def _mix64_array(z: np.ndarray) -> np.ndarray:
    """_mix64 on a uint64 array (the caller silences numpy's overflow warning: wrapping is intended)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))
