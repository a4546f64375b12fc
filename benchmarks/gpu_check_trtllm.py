"""TensorRT-LLM checks for a GPU machine (run by benchmarks/gpu_check.sh; skipped cleanly where they cannot run).

    python -m benchmarks.gpu_check_trtllm --out DIR

Sections, each recorded in DIR/gpu_check_trtllm.json (a section that raises is recorded as
{"error": ...}; one that cannot run here as {"skipped": reason}):
- graph_capture (CUDA only, no TensorRT-LLM needed): the worker's selection and copy padding
  (`worker.moespec_resampling`) for eagle3 and evict on TensorRT-LLM-shaped buffers, captured in a
  CUDA graph as TensorRT-LLM captures its drafting loop, replayed on new buffer contents and
  compared with eager runs (tokens, indices and the re-pointed parent buffer).
- trtllm_install (tensorrt_llm installed): version policy and mode, the dynamic-tree worker's
  batch-size contract, `install()` into the real modules (the class `get_spec_worker` would build),
  and the installed upstream text against the pinned excerpts of tests/backends/fixtures/trtllm/.
- trtllm_tiny (tensorrt_llm installed): moespec-tiny built as a tree engine (dry run), run by the
  Executor on TensorRT-LLM with policy eagle3, and its greedy tokens compared with our PyTorch
  engine's on the same prompt.
Exit status 1 only when a section that could run failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def graph_capture() -> dict:
    """Capture the worker's resampling in a CUDA graph and replay it on new buffers."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    from tests.backends.test_buffers import fill_history
    from tests.backends.test_padding import peaked_draft
    from trtllm_moespec.backends.trtllm.buffers import DynamicTreeHistory
    from trtllm_moespec.backends.trtllm.selection import WorkerSettings, make_selector
    from trtllm_moespec.backends.trtllm.worker import moespec_resampling
    from trtllm_moespec.core.cost import CostTable

    device = torch.device("cuda")
    B, N = 4, 32
    table = CostTable(costs=tuple(0.010 + 0.0004 * k + 0.00002 * k * k for k in range(N + 1)), model_id="gpu-check")
    path = Path(os.environ.get("TMPDIR", "/tmp")) / "gpu_check_trtllm_cost.json"
    table.save(path)
    rows = []
    for policy in ("eagle3", "evict"):
        histories = [fill_history(*peaked_draft(B, seed=s)) for s in (1, 2)]
        static = DynamicTreeHistory(*(t.to(device).clone() for t in (histories[0].draft_tokens, histories[0].scores,
                                                                      histories[0].parents)), 8, 4)
        select = make_selector(WorkerSettings(policy=policy, cost_profile=str(path)), N, device)
        for _ in range(2):  # warm up (Triton compiles) outside the capture, as TensorRT-LLM warms up
            moespec_resampling(static, select, N)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moespec_resampling(static, select, N)
        ok = True
        for history in histories:
            static.draft_tokens.copy_(history.draft_tokens)
            static.scores.copy_(history.scores)
            static.parents.copy_(history.parents)
            graph.replay()
            eager = moespec_resampling(static, select, N, checks=True)
            ok &= bool(torch.equal(out.topk_score_indices, eager.topk_score_indices))
            ok &= bool(torch.equal(out.draft_tokens, eager.draft_tokens) and torch.equal(out.parents, eager.parents))
        rows.append({"policy": policy, "captured_equals_eager": ok,
                     "copies_per_request": out.is_copy.sum(1).tolist()})
    return {"rows": rows, "passed": all(r["captured_equals_eager"] for r in rows)}


def trtllm_install() -> dict:
    if importlib.util.find_spec("tensorrt_llm") is None:
        return {"skipped": "tensorrt_llm is not installed"}
    import inspect

    from tests.backends.upstream import FIXTURES
    from trtllm_moespec.backends.trtllm import version
    from trtllm_moespec.backends.trtllm.worker import (WorkerSettings, install, installed_batch_contract,
                                                       installed_worker_name, uninstall)

    installed = version.installed_version()
    result = {"version": installed, "dynamic_tree_module": version.dynamic_tree_available(),
              "mode": version.supported_mode(installed, version.dynamic_tree_available())}
    if result["mode"] != "tree":
        return {**result, "passed": True, "note": "no dynamic tree: chain engines only"}
    result["batch_contract"] = installed_batch_contract()
    record = install(WorkerSettings(policy="eagle3"))
    from trtllm_moespec.backends.trtllm.reach import PlannedSpecConfig

    result["patched_modules"] = list(record.patched_modules)
    result["worker_class"] = installed_worker_name(PlannedSpecConfig({"speculative_config": {
        "eagle3_one_model": True, "use_dynamic_tree": True, "dynamic_tree_max_topK": 8, "max_draft_len": 4,
        "max_total_draft_tokens": 16}}))
    uninstall()
    import tensorrt_llm._torch.speculative.eagle3_dynamic_tree as dyn

    pinned = (FIXTURES / "eagle3_dynamic_tree_excerpt.py").read_text()
    result["resample_final_tokens_matches_pinned"] = inspect.getsource(dyn._resample_final_tokens).strip() in pinned
    result["passed"] = result["worker_class"] == "MoESpecDynamicTreeWorker"
    return result


def trtllm_tiny(out: Path) -> dict:
    if importlib.util.find_spec("tensorrt_llm") is None:
        return {"skipped": "tensorrt_llm is not installed"}
    from trtllm_moespec import LLM, SamplingParams, TreeConfig
    from trtllm_moespec.backends.trtllm import build
    from trtllm_moespec.runtime import Executor

    tiny = ROOT / "trtllm_moespec" / "assets" / "moespec-tiny"
    engine = out / "trtllm_tiny_engine"
    rc = build.main(["--model", str(tiny / "target"), "--draft-model", str(tiny / "eagle3"), "--policy", "eagle3",
                     "--verify-lengths", "8", "--max-draft-tokens", "8", "--tp", "1", "--ep", "1", "--out", str(engine),
                     "--dry-run"])
    if rc != 0:
        return {"error": f"moespec build --dry-run exited {rc}"}
    params = SamplingParams(max_tokens=32, temperature=0.0)
    prompt = "def fibonacci(n):\n"
    executor = Executor(engine, "tensorrt_llm")
    try:
        trt = executor.generate([prompt], params)[0]
    finally:
        executor.shutdown()
    ours = LLM(model=str(tiny / "target"), draft_model=str(tiny / "eagle3"), policy="ar", device="cuda",
               tree=TreeConfig(steps=4, topk=8, max_draft_tokens=8)).generate([prompt], params)[0]
    same = list(trt.token_ids) == list(ours.token_ids)
    return {"tokens_equal_to_pytorch_ar": same, "trtllm_tokens": list(trt.token_ids)[:32],
            "mean_accepted_tokens": trt.stats.mean_accepted_tokens, "passed": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    for name, run in (("graph_capture", graph_capture), ("trtllm_install", trtllm_install),
                      ("trtllm_tiny", lambda: trtllm_tiny(args.out))):
        t0 = time.perf_counter()
        try:
            result[name] = run()
        except Exception as e:  # noqa: BLE001 - one section failing must not lose the others
            result[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        result[name]["seconds"] = round(time.perf_counter() - t0, 1)
        (args.out / "gpu_check_trtllm.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"trtllm {name}: " + json.dumps({k: v for k, v in result[name].items() if k != "trace"})[:400])
    failed = [n for n, r in result.items() if "error" in r or r.get("passed") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
