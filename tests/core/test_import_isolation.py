"""The core imports only torch and numpy."""

import subprocess
import sys

CODE = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'transformers', 'tensorrt', 'tensorrt_llm', 'triton', 'safetensors', 'tokenizers'}:
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import trtllm_moespec.core as core
assert hasattr(core, 'verify_tree')
print('ok')
"""


def test_core_imports_without_transformers_or_tensorrt():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
