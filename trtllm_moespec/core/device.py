"""Small host values onto a device without waiting for it.

`torch.tensor(values, device="cuda")` and a plain `.to("cuda")` copy through pageable memory and
then synchronise the stream: the host waits until every kernel queued before the copy has run,
which throws away the head start the host keeps over the device. A step that does this a few times,
or a forward that does it per layer, runs at the speed of its host code plus its kernels instead of
the larger of the two. A fill kernel (one value) or a non-blocking copy from pinned memory (a list)
is queued like any kernel; PyTorch's pinned-memory cache keeps the source block until the copy ran.
On the CPU both are the plain tensor.
"""

from __future__ import annotations

from typing import Sequence

import torch


def token_tensor(token: int, device: torch.device) -> torch.Tensor:
    """[1] int64 holding `token`, made on `device` by a fill kernel."""
    return torch.full((1,), token, dtype=torch.int64, device=device)


def host_tensor(values: Sequence, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` on `device`, copied without a stream sync off the CPU."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`, copied without a stream sync (the tensor itself on the CPU)."""
    if device.type == "cpu" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
