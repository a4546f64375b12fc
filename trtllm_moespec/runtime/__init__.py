"""Running engine directories: the Executor (TensorRT-LLM or our PyTorch engine), the MPI
launcher (`python -m trtllm_moespec.runtime.launch`) and the Triton model repository writer."""

from .executor import Executor, ExecutorOutput, ExecutorStats

__all__ = ["Executor", "ExecutorOutput", "ExecutorStats"]
