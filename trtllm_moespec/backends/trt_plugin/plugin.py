"""MoESpecTreeSelect as a TensorRT-LLM Python plugin (IPluginV3 via PluginBase).

Imported only by `load_python_plugin()`: it needs tensorrt and tensorrt_llm (GPU
machines). The kernels are the Triton kernels of trtllm_moespec.kernels; the
float64 results are written to float32 outputs (TensorRT has no float64 tensors).
Shape/dtype logic and attribute checks live in spec.py, where they are tested.
"""

from typing import Sequence

import torch
# Module layout as read (schema.TRTLLM_MODULE_LAYOUT, tested against this file): python_plugin
# defines the plugin classes; convert_to_torch_tensor and TensorWrapper live in _utils.
from tensorrt_llm._utils import TensorWrapper, convert_to_torch_tensor
from tensorrt_llm.python_plugin import PluginBase, ShapeExpr, SymTensor, trtllm_plugin

from ...kernels.spec import check_inputs, parse_mode
from ...kernels.triton_select import select_tree_triton
from .spec import (OUTPUT_NAMES, PLUGIN_NAME, PLUGIN_VERSION, PYTHON_PLUGIN_NAMESPACE, PluginAttrs, output_dtypes,
                   output_shapes)

_TORCH_NAMES = {torch.float32: "float32", torch.int64: "int64", torch.bool: "bool"}


def _dtype_name(dtype) -> str:
    from tensorrt_llm._utils import trt_dtype_to_torch

    torch_dtype = dtype if isinstance(dtype, torch.dtype) else trt_dtype_to_torch(dtype)
    return _TORCH_NAMES.get(torch_dtype, str(torch_dtype))


# No `from __future__ import annotations` here: trtllm_plugin inspects real annotations.
# trtllm_plugin's namespace defaults to TensorRT-LLM's own (python_plugin.py @ 18b5fac4f805b04f15efff9962db4a0f0453e4aa);
# ours is moespec_py, not the native plugin's moespec: the two serialise differently (spec.py).
@trtllm_plugin(PLUGIN_NAME, plugin_version=PLUGIN_VERSION, plugin_namespace=PYTHON_PLUGIN_NAMESPACE,
               plugin_num_outputs=len(OUTPUT_NAMES))
class MoESpecTreeSelectPlugin(PluginBase):
    def __init__(self, mode, budget: int, c0: float = 0.0, c_tok: float = 0.0, c_exp: float = 0.0,
                 eps: float = 1e-3):
        super().__init__()
        attrs = PluginAttrs(int(parse_mode(mode)), budget, c0, c_tok, c_exp, eps)
        # Plain attributes: PluginBase serialises the instance dict.
        self.mode, self.budget = attrs.mode, attrs.budget
        self.c0, self.c_tok, self.c_exp, self.eps = attrs.c0, attrs.c_tok, attrs.c_exp, attrs.eps

    @property
    def attrs(self) -> PluginAttrs:
        return PluginAttrs(self.mode, self.budget, self.c0, self.c_tok, self.c_exp, self.eps)

    def shape_dtype_inference(self, inputs: Sequence[SymTensor]) -> tuple[SymTensor, SymTensor, SymTensor, SymTensor]:
        # PluginBase asks twice: dtypes only (shapes unknown), then shapes only (dtypes None);
        # the eager torch path passes both, with int shapes.
        dtypes = [None] * len(OUTPUT_NAMES)
        if inputs[0].dtype is not None:
            dtypes = [getattr(torch, d) for d in output_dtypes([_dtype_name(t.dtype) for t in inputs])]
        shape0 = inputs[0].shape
        if isinstance(shape0, ShapeExpr) and len(shape0) == 0:  # dtype pass
            shapes = [ShapeExpr(None, None)] * len(OUTPUT_NAMES)
        else:
            shapes = output_shapes([list(t.shape) if not isinstance(t.shape, ShapeExpr) else t.shape for t in inputs],
                                   self.attrs)
            if isinstance(shape0, ShapeExpr):
                shapes = [ShapeExpr(s, shape0.exprBuilder) for s in shapes]
        return tuple(SymTensor(d, s) for d, s in zip(dtypes, shapes))

    def forward(self, inputs: Sequence[TensorWrapper], outputs: Sequence[TensorWrapper]):
        # Known limit: PluginBase.enqueue runs this under torch.cuda.stream(ExternalStream(TensorRT's
        # stream)), hands TensorRT's workspace over as `self.workspace`, and asks for none (no
        # get_workspace_size: the IPluginV3OneBuild default, 0) -- read in tensorrt_llm/python_plugin.py
        # @ 18b5fac4f805b04f15efff9962db4a0f0453e4aa. The temporaries below come from torch's caching
        # allocator on that stream, which an engine captured into a CUDA graph cannot hold; the native
        # plugin (plugins/trt) takes its scratch from the workspace.
        scores, parents, valid, depth, bits, root, table = (convert_to_torch_tensor(t) for t in inputs)
        node_idx, count, expected, cost = (convert_to_torch_tensor(t) for t in outputs)
        a = self.attrs
        mode = parse_mode(a.mode)
        check_inputs(scores, parents, valid, depth, bits, root, table, mode, a.budget, a.c0, a.c_tok, a.c_exp, a.eps)
        idx64, count64, exp64, cost64 = select_tree_triton(scores, parents, valid, depth, bits, root, table.double(),
                                                           mode, a.budget, a.c0, a.c_tok, a.c_exp, a.eps)
        node_idx.copy_(idx64)
        count.copy_(count64)
        expected.copy_(exp64)
        cost.copy_(cost64)
