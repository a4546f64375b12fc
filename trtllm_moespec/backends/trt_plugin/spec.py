"""MoESpecTreeSelect plugin contract: attributes, their (de)serialisation, shape and
dtype inference. Plain functions (no TensorRT import) shared by the Python plugin
(plugin.py) and mirrored by the native plugin (plugins/trt/).

Plugin I/O (TensorRT has no float64 tensors, so C(k) and the two real outputs are float32):
  inputs   0 scores [B, N] float32   1 parents [B, N] int64   2 valid [B, N] bool
           3 depth [B, N] int64      4 node_bits [B, N, W] int64
           5 root_bits [B, W] int64  6 cost_table [K+1] float32
  outputs  0 node_idx [B, budget] int64   1 num_selected [B] int64
           2 expected_tokens [B] float32  3 predicted_cost [B] float32 (NaN without a cost model)
Attributes: mode (int32, kernels.spec.Mode), budget (int32), c0, c_tok, c_exp, eps (float64).

Two routes, two identities. The native plugin (plugins/trt) is `moespec::MoESpecTreeSelect` v1 and
serialises one 48-byte field "attrs" (ATTRS_FORMAT, little endian). The Python plugin (plugin.py) is
`moespec_py::MoESpecTreeSelect` v1: TensorRT-LLM's `trtllm_plugin` registers it and serialises the
instance as one pickled field "__plugin_pickle_obj__" (`PluginBase.get_fields_to_serialize`,
tensorrt_llm/python_plugin.py @ 18b5fac4f805b04f15efff9962db4a0f0453e4aa). One identity for both would
be wrong twice: TensorRT's `IPluginRegistry::loadLibrary` "will fail and return nullptr if any of the
plugins are already registered" (include/NvInferRuntimeCommon.h, NVIDIA/TensorRT v10.14 @
3b4ddc1d45f11167f2ea53dc6046bba8df800e2d), `trtllm_plugin` asserts that its own registration succeeded,
and an engine built by one route could be handed to the other's creator, which cannot read its fields.
Neither route is what the PyTorch-backend worker runs: it calls the `moespec::select_tree` torch op.
"""

from __future__ import annotations

import math
import struct
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ...kernels.spec import Mode, parse_mode

PLUGIN_NAME = "MoESpecTreeSelect"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "moespec"  # the native plugin's (plugins/trt/MoESpecTreeSelectPlugin.cpp kNamespace)
PYTHON_PLUGIN_NAMESPACE = "moespec_py"  # the Python plugin's: another serialisation, so another identity
INPUT_NAMES = ("scores", "parents", "valid", "depth", "node_bits", "root_bits", "cost_table")
OUTPUT_NAMES = ("node_idx", "num_selected", "expected_tokens", "predicted_cost")
INPUT_DTYPES = ("float32", "int64", "bool", "int64", "int64", "int64", "float32")
OUTPUT_DTYPES = ("int64", "int64", "float32", "float32")
INPUT_RANKS = (2, 2, 2, 2, 3, 2, 1)
ATTRS_MAGIC = b"MSTS"
ATTRS_VERSION = 1
ATTRS_FORMAT = "<4sIiidddd"  # magic, version, mode, budget, c0, c_tok, c_exp, eps  (48 bytes)


@dataclass(frozen=True)
class PluginAttrs:
    mode: int  # kernels.spec.Mode id
    budget: int  # output width / cap on selected nodes
    c0: float = 0.0  # joint: C(j, U) = c0 + c_tok*j + c_exp*U seconds
    c_tok: float = 0.0
    c_exp: float = 0.0
    eps: float = 1e-3  # ecospec key denominator offset

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", int(parse_mode(self.mode)))
        if not isinstance(self.budget, int) or not 1 <= self.budget < 2**31:
            raise ValueError(f"{PLUGIN_NAME} budget must be an int in [1, 2^31), got {self.budget!r}")
        for name in ("c0", "c_tok", "c_exp", "eps"):
            value = float(getattr(self, name))
            if not math.isfinite(value):
                raise ValueError(f"{PLUGIN_NAME} attribute {name} must be finite, got {value}")
            object.__setattr__(self, name, value)

    @property
    def mode_name(self) -> str:
        return Mode(self.mode).name.lower()


def serialize_attrs(attrs: PluginAttrs) -> bytes:
    """PluginAttrs -> 48 bytes (the layout plugins/trt/tree_select_attrs.h reads)."""
    return struct.pack(ATTRS_FORMAT, ATTRS_MAGIC, ATTRS_VERSION, attrs.mode, attrs.budget, attrs.c0, attrs.c_tok,
                       attrs.c_exp, attrs.eps)


def deserialize_attrs(data: bytes) -> PluginAttrs:
    """Inverse of serialize_attrs; raises ValueError on a wrong size, magic or version."""
    if len(data) != struct.calcsize(ATTRS_FORMAT):
        raise ValueError(f"{PLUGIN_NAME} attributes must be {struct.calcsize(ATTRS_FORMAT)} bytes, got {len(data)}")
    magic, version, mode, budget, c0, c_tok, c_exp, eps = struct.unpack(ATTRS_FORMAT, data)
    if magic != ATTRS_MAGIC or version != ATTRS_VERSION:
        raise ValueError(f"not {PLUGIN_NAME} attributes (magic {magic!r}, version {version})")
    return PluginAttrs(mode, budget, c0, c_tok, c_exp, eps)


def attrs_to_fields(attrs: PluginAttrs) -> dict[str, tuple[str, Any]]:
    """Creator fields: name -> (field type, value), e.g. {'mode': ('int32', 3), 'c0': ('float64', 1e-3)}."""
    return {k: ("int32" if k in ("mode", "budget") else "float64", v) for k, v in asdict(attrs).items()}


def attrs_from_fields(fields: dict[str, Any]) -> PluginAttrs:
    """Creator fields (name -> scalar or 1-element array) -> PluginAttrs; mode and budget are required."""
    unknown = set(fields) - set(PluginAttrs.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown {PLUGIN_NAME} fields {sorted(unknown)}")
    for required in ("mode", "budget"):
        if required not in fields:
            raise ValueError(f"{PLUGIN_NAME} needs the field {required!r}")

    def scalar(x):
        return x.reshape(-1)[0].item() if hasattr(x, "reshape") else x

    values = {k: scalar(v) for k, v in fields.items()}
    values["mode"], values["budget"] = int(values["mode"]), int(values["budget"])
    return PluginAttrs(**values)


def output_shapes(input_shapes: Sequence[Sequence[Any]], attrs: PluginAttrs) -> list[list[Any]]:
    """Output shapes from input shapes; dims may be ints or symbolic (TensorRT DimensionExpr)."""
    if len(input_shapes) != len(INPUT_NAMES):
        raise ValueError(f"{PLUGIN_NAME} takes {len(INPUT_NAMES)} inputs {INPUT_NAMES}, got {len(input_shapes)}")
    for name, shape, rank in zip(INPUT_NAMES, input_shapes, INPUT_RANKS):
        if len(shape) != rank:
            raise ValueError(f"{PLUGIN_NAME} input {name} must have rank {rank}, got {len(shape)}")
    batch = input_shapes[0][0]
    return [[batch, attrs.budget], [batch], [batch], [batch]]


def output_dtypes(input_dtypes: Sequence[str]) -> list[str]:
    """Output dtype names; raises ValueError when an input dtype is not the plugin's."""
    if len(input_dtypes) != len(INPUT_NAMES):
        raise ValueError(f"{PLUGIN_NAME} takes {len(INPUT_NAMES)} inputs, got {len(input_dtypes)} dtypes")
    for name, got, want in zip(INPUT_NAMES, input_dtypes, INPUT_DTYPES):
        if got != want:
            raise ValueError(f"{PLUGIN_NAME} input {name} must be {want}, got {got}")
    return list(OUTPUT_DTYPES)
