"""Which tensorrt_llm versions run which MoESpec mode: the version policy, in one place.

Two lines of TensorRT-LLM exist for us (what was read is in schema.py):

| tensorrt_llm | draft mode | MoESpec selection inside TensorRT-LLM |
|---|---|---|
| 1.2.x (`>=1.2.0,<1.3.0.dev0`) | "chain": linear EAGLE-3, one `max_draft_len` per profile | none (TensorRT-LLM verifies the chain) |
| `>=1.3.0.dev0,<2` **and** the module `eagle3_dynamic_tree` present (a release or pinned commit containing PR #13081) | "tree": EAGLE-3 dynamic tree (and chain) | `MoESpecDynamicTreeWorker` |
| `>=1.3.0.dev0,<2` without that module | "chain" only | none |
| anything else | refused with one error naming the version | |

Chain engines therefore record `>=1.2.0,<2.0.0`, tree engines `>=1.3.0.dev0,<2.0.0`
(`engine_range`); `moespec build` checks the installed version against it before writing.

Why: `tensorrt_llm/_torch/speculative/eagle3_dynamic_tree.py` is newer than the 1.2 line
(PR #12062 landed it, #13006 reverted it, #13081 re-landed it: dates as recorded in issue 11).
Read: the module is imported by `_torch/speculative/utils.py` @
011d0933dcb5e592f5fa2626beaf42a96324c578, whose `get_spec_worker` builds it when
`_is_effective_dynamic_tree` holds, while utils.py @ 3e906a0ed7c66ed4df90aa4856bf1a6c98ca7df6
builds only the linear `Eagle3OneModelWorker`; the 1.2 line is represented by
b35ac1b64368513d215c57d2ed01d62d910df8da (`tensorrt_llm/version.py` "1.2.0rc2", whose
`_torch/speculative/interface.py` has neither the dynamic-tree mode nor the forced-acceptance
knob). On 1.2.x `validate_eagle_config` sets `max_total_draft_tokens = max_draft_len` (issue 11's
record), so a "tree" profile there would silently run a chain; `check_effective_draft_tokens`
checks the built LLM for exactly that. A 1.3 pre-release from before #13081 lacks the module,
which is why the module itself is checked (`importlib.util.find_spec`), not only the version string;
and two dynamic-tree workers with different constructor contracts exist under 1.3 pre-release
versions, which worker.worker_batch_contract reads from the constructor itself.

TensorRT-LLM is never imported at module import time.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .schema import (CHAIN_ENGINE_RANGE, CHAIN_LINE_MAX, CHAIN_LINE_MIN, CHAIN_LINE_RANGE, DYNAMIC_TREE_MODULE,
                     TREE_LINE_MAX, TREE_LINE_MIN, TREE_LINE_RANGE)

DRAFT_MODES = ("tree", "chain")
# The `--trtllm-line` choices of `moespec build` and the range each one stands for.
TRTLLM_LINES = {"1.2": CHAIN_LINE_RANGE, "dynamic-tree": TREE_LINE_RANGE}
DYNAMIC_TREE_PR = "#13081"


class UnsupportedTensorRTLLMVersion(RuntimeError):
    """The installed tensorrt_llm cannot run what was asked of it (message says what to do)."""


def trtllm_available() -> bool:
    """True when a `tensorrt_llm` package is importable (found; not imported)."""
    try:
        return importlib.util.find_spec("tensorrt_llm") is not None
    except (ImportError, ValueError):
        return False


def dynamic_tree_available() -> bool:
    """True when `tensorrt_llm._torch.speculative.eagle3_dynamic_tree` exists (imports its parents)."""
    if sys.modules.get(DYNAMIC_TREE_MODULE) is not None:
        return True
    try:
        return importlib.util.find_spec(DYNAMIC_TREE_MODULE) is not None
    except (ImportError, ValueError):
        return False


def installed_version() -> str:
    """The `__version__` of the installed tensorrt_llm (imports it)."""
    module = importlib.import_module("tensorrt_llm")
    version = getattr(module, "__version__", None)
    if not isinstance(version, str):
        raise UnsupportedTensorRTLLMVersion("tensorrt_llm has no __version__ string; cannot check compatibility")
    return version


def _parse(version: str) -> Version:
    try:
        return Version(version)
    except InvalidVersion:
        raise UnsupportedTensorRTLLMVersion(f"tensorrt_llm version {version!r} is not a valid version string") from None


def supported_mode(version: str, has_dynamic_tree: bool) -> str:
    """The most a tensorrt_llm can run: 'tree' or 'chain'; UnsupportedTensorRTLLMVersion otherwise.

    Pre-releases of 1.2.0 are outside (the 1.2 internals are not guaranteed there); a 1.3
    build without the dynamic-tree module still runs linear EAGLE-3 (chain engines).
    """
    v = _parse(version)
    if Version(CHAIN_LINE_MIN) <= v < Version(CHAIN_LINE_MAX):
        return "chain"
    if Version(TREE_LINE_MIN) <= v < Version(TREE_LINE_MAX):
        return "tree" if has_dynamic_tree else "chain"
    raise UnsupportedTensorRTLLMVersion(
        f"tensorrt_llm {version} is not supported by trtllm_moespec (chain engines need {CHAIN_ENGINE_RANGE}, "
        f"tree engines {TREE_LINE_RANGE} with {DYNAMIC_TREE_MODULE})")


def check_engine_mode(engine_mode: str, version: str, has_dynamic_tree: bool) -> str:
    """Return `version` if it can run an engine of `engine_mode`; else one error saying what to do."""
    if engine_mode not in DRAFT_MODES:
        raise ValueError(f"unknown draft mode {engine_mode!r}; expected one of {DRAFT_MODES}")
    mode = supported_mode(version, has_dynamic_tree)
    if engine_mode == "tree" and mode != "tree":
        if _parse(version) >= Version(TREE_LINE_MIN):
            raise UnsupportedTensorRTLLMVersion(
                f"tensorrt_llm {version} lacks {DYNAMIC_TREE_MODULE} (PR {DYNAMIC_TREE_PR}); install a release or "
                f"commit that contains it, or rebuild the engine with `moespec build --trtllm-line 1.2` (chain)")
        raise UnsupportedTensorRTLLMVersion(
            f"this engine drafts an EAGLE-3 dynamic tree, which tensorrt_llm {version} does not have "
            f"(1.2.x forces max_total_draft_tokens = max_draft_len); rebuild it with `moespec build --trtllm-line 1.2` "
            f"or install tensorrt_llm {TREE_LINE_RANGE} containing PR {DYNAMIC_TREE_PR}")
    return version


def engine_range(mode: str) -> str:
    """The tensorrt_llm versions an engine of `mode` really needs (recorded in moespec.json).

    Chain engines use TensorRT-LLM's own linear EAGLE-3 worker, unmodified: 1.2.x and the tree line
    both run them. Tree engines need the dynamic-tree module (checked apart, it is not a version).
    """
    if mode not in DRAFT_MODES:
        raise ValueError(f"unknown draft mode {mode!r}; expected one of {DRAFT_MODES}")
    return TREE_LINE_RANGE if mode == "tree" else CHAIN_ENGINE_RANGE


def check_version_range(version: str, version_range: str) -> str:
    """`version` if it lies in `version_range` (pre-releases included); else UnsupportedTensorRTLLMVersion."""
    if not SpecifierSet(version_range, prereleases=True).contains(_parse(version), prereleases=True):
        raise UnsupportedTensorRTLLMVersion(f"tensorrt_llm {version} is outside {version_range}, the range this "
                                            "engine was built for; install a version in it or rebuild the engine")
    return version


def check_installed(engine_mode: str, version_range: str | None = None) -> str:
    """check_engine_mode (and the engine's recorded range) against the installed tensorrt_llm (imports it)."""
    version = check_engine_mode(engine_mode, installed_version(), dynamic_tree_available())
    return check_version_range(version, version_range) if version_range else version


def line_range(line: str) -> str:
    """The version range of a `--trtllm-line` choice; ValueError for unknown lines."""
    if line not in TRTLLM_LINES:
        raise ValueError(f"unknown TensorRT-LLM line {line!r}; choose one of {sorted(TRTLLM_LINES)}")
    return TRTLLM_LINES[line]


def check_effective_draft_tokens(spec_config: object, verify_length: int, max_draft_len: int) -> None:
    """Raise UnsupportedTensorRTLLMVersion unless TensorRT-LLM kept the profile's draft sizes.

    spec_config: the `speculative_config` of a built `LLM` (its `args`), after its
    validators ran. Catches a tensorrt_llm that rewrites max_total_draft_tokens (1.2.x
    does for any EAGLE config), which would otherwise make every profile measure the
    same size.
    """
    total = getattr(spec_config, "max_total_draft_tokens", None)
    draft_len = getattr(spec_config, "max_draft_len", None)
    if total != verify_length or draft_len != max_draft_len:
        raise UnsupportedTensorRTLLMVersion(
            f"TensorRT-LLM changed the profile's draft sizes: max_total_draft_tokens={total!r}, "
            f"max_draft_len={draft_len!r}, but the profile needs {verify_length} and {max_draft_len}; "
            "this tensorrt_llm cannot run this engine's profile (see the version table in the backend README)")
