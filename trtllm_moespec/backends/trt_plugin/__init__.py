"""TensorRT plugin `MoESpecTreeSelect` (Python route through TensorRT-LLM).

spec.py (attributes, serialisation, shape/dtype inference) imports neither
TensorRT nor TensorRT-LLM. `load_python_plugin()` imports plugin.py, which
subclasses tensorrt_llm.python_plugin.PluginBase and registers the plugin; it
needs a machine with TensorRT-LLM and a GPU. The native C++ plugin lives in
plugins/trt/. The two register under different namespaces (moespec_py here, moespec
there: spec.py says why), and neither is what the PyTorch-backend worker runs (it calls
the `moespec::select_tree` torch op).
"""

from __future__ import annotations

from .spec import (PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION, PYTHON_PLUGIN_NAMESPACE, PluginAttrs,
                   attrs_from_fields, attrs_to_fields, deserialize_attrs, output_dtypes, output_shapes, serialize_attrs)


def load_python_plugin():
    """Import and register the Python plugin class; raises ImportError without TensorRT-LLM."""
    from .plugin import MoESpecTreeSelectPlugin

    return MoESpecTreeSelectPlugin


__all__ = ["PLUGIN_NAME", "PLUGIN_NAMESPACE", "PLUGIN_VERSION", "PYTHON_PLUGIN_NAMESPACE", "PluginAttrs", "attrs_from_fields", "attrs_to_fields",
           "deserialize_attrs", "load_python_plugin", "output_dtypes", "output_shapes", "serialize_attrs"]
