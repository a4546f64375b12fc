"""An importable stand-in `tensorrt_llm` package, written to disk for real-process tests.

TensorRT-LLM cannot be installed on these machines. To test that our install logic
reaches every process TensorRT-LLM would build the model in, we write a package with
the same module names and the few functions our code touches, each following what
was read in TensorRT-LLM's sources (citations in trtllm_moespec/backends/trtllm/
schema.py):

- `_torch/speculative/utils.py`: `get_spec_worker(spec_config, model_config, mapping,
  use_separate_draft_kv_cache=False)` picking the dynamic-tree worker by
  `_is_effective_dynamic_tree` (omitted with effective_helper=False, as before #15842);
- `_torch/speculative/__init__.py` re-exports it and `_torch/models/
  modeling_speculative.py` imports it by name (the two places install() rebinds);
- `_torch/speculative/eagle3_dynamic_tree.py` only when with_dynamic_tree (absent on 1.2.x);
- `executor/worker.py`: `worker_main(spec)`, what a spawned worker runs (builds the worker);
- `LLM(**args)`: builds the worker as `GenerationExecutor.create` would for one GPU:
  in this process when TLLM_WORKER_USE_SINGLE_PROCESS=1, otherwise in a freshly
  spawned Python process; `worker_class` records what was built, `args.speculative_config`
  the effective config (max_total_draft_tokens forced to max_draft_len on 1.2.x).
Nothing of it is used outside tests.
"""

from pathlib import Path

INIT = '''__version__ = {version!r}
import os, subprocess, sys
from types import SimpleNamespace


def _config(spec):
    from tensorrt_llm._torch.speculative.utils import SpecConfig
    return SpecConfig(spec)


class LLM:
    def __init__(self, model=None, speculative_config=None, **kwargs):
        cfg = _config(speculative_config or {{}})
        self.args = SimpleNamespace(speculative_config=cfg)
        if os.environ.get("TLLM_WORKER_USE_SINGLE_PROCESS") == "1":
            from tensorrt_llm._torch.models.modeling_speculative import get_spec_worker
            self.worker_class = type(get_spec_worker(cfg, None, "mapping")).__name__
        else:  # a spawned worker process: a fresh interpreter that imports tensorrt_llm itself
            code = ("import json, sys; from tensorrt_llm import _config; "
                    "from tensorrt_llm._torch.models.modeling_speculative import get_spec_worker; "
                    "print(type(get_spec_worker(_config(json.loads(sys.argv[1])), None, 'mapping')).__name__)")
            import json
            out = subprocess.run([sys.executable, "-c", code, json.dumps(speculative_config or {{}})],
                                 capture_output=True, text=True, check=True)
            self.worker_class = out.stdout.strip()

    def shutdown(self):
        pass


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)
'''

LLM_UTILS = '''def update_llm_args_with_extra_dict(args, extra):
    return {**args, **extra}
'''

UTILS = '''import torch
from .eagle3 import Eagle3OneModelWorker


class _Mode:
    def __init__(self, one_model):
        self._one_model = one_model

    def is_eagle3_one_model(self):
        return self._one_model


class SpecConfig:
    def __init__(self, spec):
        self.spec_dec_mode = _Mode(bool(spec.get("eagle3_one_model")))
        self.use_dynamic_tree = bool(spec.get("use_dynamic_tree"))
        self.dynamic_tree_max_topK = int(spec.get("dynamic_tree_max_topK") or 0)
        self.max_draft_len = spec.get("max_draft_len")
        self._max_batch_size = 2  # filled from the LLM's max_batch_size (the private contract)
        total = spec.get("max_total_draft_tokens")
        self.max_total_draft_tokens = {force_linear} and self.max_draft_len or total
{effective}

def get_spec_worker(spec_config, model_config, mapping, use_separate_draft_kv_cache: bool = False):
    if spec_config.spec_dec_mode.is_eagle3_one_model() and {predicate}:
        from .eagle3_dynamic_tree import Eagle3OneModelDynamicTreeWorker
        return Eagle3OneModelDynamicTreeWorker(spec_config, mapping, use_separate_draft_kv_cache)
    return Eagle3OneModelWorker(spec_config, mapping)
'''

EFFECTIVE = '''

def _is_effective_dynamic_tree(spec_config):
    return bool(spec_config.use_dynamic_tree) and spec_config.dynamic_tree_max_topK > 1
'''

EAGLE3 = '''class Eagle3OneModelWorker:
    def __init__(self, spec_config, mapping, use_separate_draft_kv_cache=False):
        self.spec_config = spec_config
'''

DYNAMIC_TREE = '''import torch
from .eagle3 import Eagle3OneModelWorker


class Eagle3OneModelDynamicTreeWorker(Eagle3OneModelWorker):
    def __init__(self, spec_config, mapping, use_separate_draft_kv_cache=False):
        super().__init__(spec_config, mapping, use_separate_draft_kv_cache)
        self._max_batch_size = spec_config._max_batch_size
        K, D = spec_config.dynamic_tree_max_topK, spec_config.max_draft_len
        self.K, self.max_draft_len = K, D
        self.max_total_draft_tokens = spec_config.max_total_draft_tokens
        self.history_draft_tokens_buffer = torch.zeros(2, K + K * K * (D - 1), dtype=torch.int32)
        self.history_score_buffer = torch.zeros(2, K + K * K * (D - 1), dtype=torch.float32)
        self.history_draft_tokens_parent_buffer = torch.zeros(2, max(K * (D - 1) + 1, K + 1), dtype=torch.int64)
'''


WORKER_MAIN = '''def worker_main(spec):
    """What a spawned TensorRT-LLM worker runs (executor/worker.py): it builds the model, here only the
    speculative worker, and reports its class."""
    from tensorrt_llm import _config
    from tensorrt_llm._torch.models.modeling_speculative import get_spec_worker
    return type(get_spec_worker(_config(spec), None, "mapping")).__name__
'''


def write_standin(root: Path, version: str = "1.3.0rc9", with_dynamic_tree: bool = True,
                  effective_helper: bool = True) -> Path:
    """Write the package under root/tensorrt_llm; returns root (put it on PYTHONPATH)."""
    pkg = root / "tensorrt_llm"
    files = {
        "__init__.py": INIT.format(version=version),
        "llmapi/__init__.py": "",
        "llmapi/llm_utils.py": LLM_UTILS,
        "_torch/__init__.py": "",
        "_torch/speculative/__init__.py": "from .utils import get_spec_worker\n",
        "_torch/speculative/eagle3.py": EAGLE3,
        "_torch/speculative/utils.py": UTILS.format(
            force_linear=not with_dynamic_tree, effective=EFFECTIVE if effective_helper else "",
            predicate="_is_effective_dynamic_tree(spec_config)" if effective_helper else "spec_config.use_dynamic_tree"),
        "_torch/models/__init__.py": "",
        "_torch/models/modeling_speculative.py": "from ..speculative import get_spec_worker\n",
        "executor/__init__.py": "",
        "executor/worker.py": WORKER_MAIN,
    }
    if with_dynamic_tree:
        files["_torch/speculative/eagle3_dynamic_tree.py"] = DYNAMIC_TREE
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root
