"""Small host values onto a device (core/device.py); the no-sync property itself is checked on CUDA
(`tests/engine/test_cuda_engine.py`)."""

import torch

from trtllm_moespec.core.device import host_tensor, token_tensor


def test_host_values_on_the_cpu_are_the_plain_tensors():
    cpu = torch.device("cpu")
    assert torch.equal(host_tensor([3, 1, 4], cpu), torch.tensor([3, 1, 4]))
    assert host_tensor([0.5, 2.0], cpu, torch.float32).dtype == torch.float32
    t = token_tensor(7, cpu)
    assert t.dtype == torch.int64 and t.tolist() == [7]
