"""Which tensorrt_llm versions the adapter accepts, and how we find out without importing it.

TensorRT-LLM is never imported at module import time: `trtllm_available()` only
asks the import system whether the package exists, and `installed_version()`
imports it on demand (that import needs a CUDA machine).
"""

from __future__ import annotations

import importlib
import importlib.util

from packaging.version import InvalidVersion, Version

from .schema import SUPPORTED_TRTLLM_MAX, SUPPORTED_TRTLLM_MIN, SUPPORTED_TRTLLM_RANGE


class UnsupportedTensorRTLLMVersion(RuntimeError):
    """The installed tensorrt_llm is outside the range the adapter was written against."""


def trtllm_available() -> bool:
    """True when a `tensorrt_llm` package is importable (found; not imported)."""
    try:
        return importlib.util.find_spec("tensorrt_llm") is not None
    except (ImportError, ValueError):
        return False


def installed_version() -> str:
    """The `__version__` of the installed tensorrt_llm (imports it)."""
    module = importlib.import_module("tensorrt_llm")
    version = getattr(module, "__version__", None)
    if not isinstance(version, str):
        raise UnsupportedTensorRTLLMVersion("tensorrt_llm has no __version__ string; cannot check compatibility")
    return version


def is_supported(version: str) -> bool:
    """Whether `version` lies in [SUPPORTED_TRTLLM_MIN, SUPPORTED_TRTLLM_MAX) (PEP 440 order).

    Pre-releases of the minimum (e.g. 1.2.0rc2) are outside: the dynamic-tree
    worker we subclass is not guaranteed in them.
    """
    try:
        v = Version(version)
    except InvalidVersion:
        return False
    return Version(SUPPORTED_TRTLLM_MIN) <= v < Version(SUPPORTED_TRTLLM_MAX)


def check_version(version: str | None = None) -> str:
    """Return the version if supported, else raise UnsupportedTensorRTLLMVersion.

    version: the string to check; None means the installed tensorrt_llm's.
    """
    if version is None:
        version = installed_version()
    try:
        Version(version)
    except InvalidVersion:
        raise UnsupportedTensorRTLLMVersion(f"tensorrt_llm version {version!r} is not a valid version string") from None
    if not is_supported(version):
        raise UnsupportedTensorRTLLMVersion(
            f"tensorrt_llm {version} is not supported by trtllm_moespec (needs {SUPPORTED_TRTLLM_RANGE}); "
            "its speculative-decoding internals differ, so the MoESpec worker will not be installed"
        )
    return version
