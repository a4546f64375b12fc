"""The native TensorRT plugin (plugins/trt) compiles against TensorRT's real public headers.

`../shared/third_party/tensorrt/{10.14,11.1}/include` (beside the repository, as CI
clones it) holds NVIDIA/TensorRT's `include/` at those tags. Each translation unit
includes the plugin source and instantiates the plugin and its creator, so a pure
virtual left unimplemented (an interface drift between TensorRT versions) is a
compile error. A mutated copy with one override removed must fail, which shows the
check can fail.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_DIR = ROOT / "plugins" / "trt"
HEADERS = ROOT.parent / "shared" / "third_party" / "tensorrt"
CUDA_INCLUDE = Path("/usr/local/cuda-13.0/include")
VERSIONS = ("10.14", "11.1")

INSTANTIATE = """
#include "MoESpecTreeSelectPlugin.cpp"
namespace {
// Constructing both objects fails to compile if either class is still abstract.
[[maybe_unused]] void moespecInstantiateAll() {
  MoespecPluginAttrs attrs{};
  MoESpecTreeSelectPlugin plugin(attrs);
  MoESpecTreeSelectCreator creator;
  (void)plugin;
  (void)creator;
}
}  // namespace
"""


def _missing() -> str | None:
    if shutil.which("g++") is None:
        return "g++ is not installed"
    if not (CUDA_INCLUDE / "cuda_runtime_api.h").is_file():
        return f"CUDA headers not found at {CUDA_INCLUDE}"
    absent = [v for v in VERSIONS if not (HEADERS / v / "include" / "NvInferRuntime.h").is_file()]
    if absent:
        return f"TensorRT headers {absent} not found under {HEADERS} (clone shared/ beside the repository)"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


def _compile(unit: Path, version: str, source_dir: Path) -> subprocess.CompletedProcess:
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wno-deprecated-declarations",
           f"-I{HEADERS / version / 'include'}", f"-I{CUDA_INCLUDE}", f"-I{source_dir}", str(unit)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("version", VERSIONS)
def test_plugin_and_creator_compile_against_tensorrt_headers(version, tmp_path):
    unit = tmp_path / "instantiate.cpp"
    unit.write_text(INSTANTIATE)
    result = _compile(unit, version, PLUGIN_DIR)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "error" not in result.stderr


def test_a_missing_override_fails_to_compile(tmp_path):
    """Drop getNbOutputs (pure virtual in IPluginV3OneBuild): the plugin becomes abstract."""
    source = (PLUGIN_DIR / "MoESpecTreeSelectPlugin.cpp").read_text()
    lines = [line for line in source.splitlines() if "getNbOutputs() const noexcept override" not in line]
    assert len(lines) == len(source.splitlines()) - 1, "the override to remove was not found exactly once"
    mutated = tmp_path / "src"
    mutated.mkdir()
    for header in PLUGIN_DIR.glob("*.h"):
        shutil.copy(header, mutated / header.name)
    (mutated / "MoESpecTreeSelectPlugin.cpp").write_text("\n".join(lines) + "\n")
    unit = tmp_path / "instantiate.cpp"
    unit.write_text(INSTANTIATE)
    result = _compile(unit, VERSIONS[-1], mutated)
    assert result.returncode != 0 and "abstract" in result.stderr


def _native_identity() -> tuple[str, str, str]:
    import re

    source = (PLUGIN_DIR / "MoESpecTreeSelectPlugin.cpp").read_text()
    found = {k: re.search(rf'char const\* const {k} = "([^"]*)";', source).group(1)
             for k in ("kName", "kVersion", "kNamespace")}
    return found["kName"], found["kVersion"], found["kNamespace"]


def _python_identity() -> tuple[str, str, str]:
    """(name, version, namespace) the Python plugin's @trtllm_plugin decorator registers, read from its source."""
    import ast

    from trtllm_moespec.backends.trt_plugin import spec

    tree = ast.parse((ROOT / "trtllm_moespec" / "backends" / "trt_plugin" / "plugin.py").read_text())
    decorator = next(d for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for d in node.decorator_list
                     if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "trtllm_plugin")
    value = lambda node: getattr(spec, node.id) if isinstance(node, ast.Name) else node.value  # noqa: E731
    keywords = {k.arg: value(k.value) for k in decorator.keywords if k.arg in ("plugin_version", "plugin_namespace")}
    return value(decorator.args[0]), keywords.get("plugin_version", "1"), keywords["plugin_namespace"]


def test_native_and_python_plugins_register_distinct_identities():
    """F3: both routes named moespec::MoESpecTreeSelect v1 but serialising differently (48-byte "attrs" against
    TensorRT-LLM's pickled "__plugin_pickle_obj__") would collide: TensorRT's loadLibrary fails when a plugin is
    already registered (NvInferRuntimeCommon.h, TensorRT v10.14 @ 3b4ddc1d45f11167f2ea53dc6046bba8df800e2d) and
    trtllm_plugin asserts its registration (python_plugin.py @ 18b5fac4f805b04f15efff9962db4a0f0453e4aa)."""
    native, python = _native_identity(), _python_identity()
    assert native == ("MoESpecTreeSelect", "1", "moespec")
    assert python[0] == native[0] and python != native and python[2] == "moespec_py"
    header = (HEADERS / "10.14" / "include" / "NvInferRuntimeCommon.h").read_text()
    assert "fail and return nullptr if any of the plugins are already registered" in " ".join(header.replace("//!", "").split())
