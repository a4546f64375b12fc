"""MoESpecTreeSelect plugin contract: attribute (de)serialisation (Python == the C++
header the native plugin uses), shape and dtype inference."""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_moespec.backends.trt_plugin import (PluginAttrs, attrs_from_fields, attrs_to_fields, deserialize_attrs,
                                                load_python_plugin, output_dtypes, output_shapes, serialize_attrs)
from trtllm_moespec.backends.trt_plugin.spec import INPUT_DTYPES

ROOT = Path(__file__).resolve().parents[2]
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
attrs_st = st.builds(PluginAttrs, mode=st.integers(0, 3), budget=st.integers(1, 2**31 - 1), c0=finite, c_tok=finite,
                     c_exp=finite, eps=finite)


@settings(max_examples=50, deadline=None)
@given(attrs=attrs_st)
def test_attrs_roundtrip(attrs):
    data = serialize_attrs(attrs)
    assert len(data) == 48 and data[:4] == b"MSTS"
    assert deserialize_attrs(data) == attrs
    assert attrs_from_fields({k: v for k, (_, v) in attrs_to_fields(attrs).items()}) == attrs


def test_attrs_reject_bad_input():
    good = serialize_attrs(PluginAttrs("joint", 8, 1e-3, 1e-5, 1e-7))
    with pytest.raises(ValueError, match="bytes"):
        deserialize_attrs(good[:-1])
    with pytest.raises(ValueError, match="magic"):
        deserialize_attrs(b"XXXX" + good[4:])
    with pytest.raises(ValueError, match="budget"):
        PluginAttrs("evict", 0)
    with pytest.raises(ValueError, match="mode"):
        PluginAttrs(7, 4)
    with pytest.raises(ValueError, match="finite"):
        PluginAttrs("joint", 4, c0=float("nan"))
    with pytest.raises(ValueError, match="needs the field 'budget'"):
        attrs_from_fields({"mode": 1})
    with pytest.raises(ValueError, match="unknown"):
        attrs_from_fields({"mode": 1, "budget": 2, "gamma": 3})


class Sym:
    """A stand-in for a symbolic dimension (TensorRT DimensionExpr): only passed through."""

    def __init__(self, name):
        self.name = name


def test_output_shapes_ints_and_symbols():
    attrs = PluginAttrs("ecospec", 12)
    shapes = [[4, 64], [4, 64], [4, 64], [4, 64], [4, 64, 96], [4, 96], [33]]
    assert output_shapes(shapes, attrs) == [[4, 12], [4], [4], [4]]
    B, N, W, K = Sym("B"), Sym("N"), Sym("W"), Sym("K")
    out = output_shapes([[B, N], [B, N], [B, N], [B, N], [B, N, W], [B, W], [K]], attrs)
    assert out[0][0] is B and out[0][1] == 12 and all(o[0] is B for o in out[1:])
    with pytest.raises(ValueError, match="node_bits must have rank 3"):
        output_shapes([[4, 64]] * 4 + [[4, 64], [4, 96], [33]], attrs)
    with pytest.raises(ValueError, match="7 inputs"):
        output_shapes(shapes[:6], attrs)


def test_output_dtypes():
    assert output_dtypes(list(INPUT_DTYPES)) == ["int64", "int64", "float32", "float32"]
    with pytest.raises(ValueError, match="scores must be float32"):
        output_dtypes(["float16", *INPUT_DTYPES[1:]])


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")
@settings(max_examples=20, deadline=None)
@given(attrs=attrs_st)
def test_cpp_attrs_header_matches_python(cpp_attrs, attrs):
    buf = ctypes.create_string_buffer(48)
    cpp_attrs.pack(attrs.mode, attrs.budget, attrs.c0, attrs.c_tok, attrs.c_exp, attrs.eps, buf)
    assert buf.raw == serialize_attrs(attrs)
    out = (ctypes.c_double * 6)()
    assert cpp_attrs.unpack(serialize_attrs(attrs), 48, out) == 1
    assert list(out) == [attrs.mode, attrs.budget, attrs.c0, attrs.c_tok, attrs.c_exp, attrs.eps]
    assert cpp_attrs.unpack(b"MSTX" + serialize_attrs(attrs)[4:], 48, out) == 0


_SHIM = r"""
#include "tree_select_attrs.h"
extern "C" void pack(int mode, int budget, double c0, double c_tok, double c_exp, double eps, unsigned char* out) {
  MoespecPluginAttrs a{mode, budget, c0, c_tok, c_exp, eps};
  moespec_attrs_pack(a, out);
}
extern "C" int unpack(const void* data, size_t size, double* out) {
  MoespecPluginAttrs a;
  if (!moespec_attrs_unpack(data, size, &a)) return 0;
  double v[6] = {double(a.mode), double(a.budget), a.c0, a.c_tok, a.c_exp, a.eps};
  for (int i = 0; i < 6; ++i) out[i] = v[i];
  return 1;
}
"""


@pytest.fixture(scope="module")
def cpp_attrs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attrs")
    (tmp / "shim.cpp").write_text(_SHIM)
    lib = tmp / "libattrs.so"
    subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Werror", "-I",
                    str(ROOT / "plugins" / "trt"), "-o", str(lib), str(tmp / "shim.cpp")], check=True)
    so = ctypes.CDLL(str(lib))
    so.pack.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_double] * 4 + [ctypes.c_char_p]
    so.unpack.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_double)]
    so.unpack.restype = ctypes.c_int
    return so


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="TensorRT-LLM is installed here")
def test_python_plugin_import_is_lazy():
    # Importing the package works without TensorRT-LLM; only loading the plugin class needs it.
    with pytest.raises(ImportError):
        load_python_plugin()


def test_python_plugin_source_compiles():
    # plugin.py cannot be imported here (no TensorRT-LLM); at least it must be valid Python.
    src = ROOT / "trtllm_moespec" / "backends" / "trt_plugin" / "plugin.py"
    compile(src.read_text(), str(src), "exec")


def _plugin_imports():
    """(module, name) for every `from tensorrt_llm... import name` in plugin.py, and its decorator call."""
    import ast

    tree = ast.parse((ROOT / "trtllm_moespec" / "backends" / "trt_plugin" / "plugin.py").read_text())
    imports = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and node.module and node.module.startswith("tensorrt_llm") for alias in node.names]
    decorator = next(d for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for d in node.decorator_list
                     if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "trtllm_plugin")
    return imports, decorator


def test_python_plugin_imports_match_the_recorded_module_layout():
    """Each name comes from the module that defines it (schema.TRTLLM_MODULE_LAYOUT, read from
    TensorRT-LLM's python_plugin.py and _utils.py): convert_to_torch_tensor is in _utils."""
    from trtllm_moespec.backends.trtllm.schema import TRTLLM_MODULE_LAYOUT

    imports, _ = _plugin_imports()
    assert ("tensorrt_llm._utils", "convert_to_torch_tensor") in imports
    wrong = [(m, n) for m, n in imports if n not in TRTLLM_MODULE_LAYOUT.get(m, frozenset())]
    assert wrong == [], f"imported from a module that does not define them: {wrong}"


def test_python_plugin_registers_in_the_moespec_namespace():
    """trtllm_plugin defaults to TensorRT-LLM's namespace; ours must name its own (moespec_py, issue 26 F3)."""
    import ast

    from trtllm_moespec.backends.trt_plugin.spec import PLUGIN_NAMESPACE

    _, decorator = _plugin_imports()
    keywords = {k.arg: k.value for k in decorator.keywords}
    assert isinstance(keywords.get("plugin_namespace"), ast.Name)
    assert keywords["plugin_namespace"].id == "PYTHON_PLUGIN_NAMESPACE"
    native = (ROOT / "plugins" / "trt" / "MoESpecTreeSelectPlugin.cpp").read_text()
    assert f'kNamespace = "{PLUGIN_NAMESPACE}"' in native
