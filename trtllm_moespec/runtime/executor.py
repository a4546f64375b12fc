"""`Executor(engine_dir)`: run an engine directory on TensorRT-LLM or on our PyTorch engine.

The executor reads `moespec.json` and picks a backend:
- "tensorrt_llm" when tensorrt_llm is importable: checks the version policy, makes
  TensorRT-LLM build the model in this process (one GPU) or on MPI ranks that all
  installed the worker (backends/trtllm/reach.py), installs the MoESpec worker (tree
  mode), builds `tensorrt_llm.LLM` from the engine's YAML and checks that TensorRT-LLM
  kept the profile's draft sizes;
- "pytorch" otherwise: `trtllm_moespec.LLM` with the same checkpoints, policy,
  tree, cost profile and predictor.
It logs a warning naming the backend that runs. `generate` takes our
`SamplingParams` and returns outputs with `.text`, `.token_ids`, `.stats`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

from ..backends.trtllm.config import EngineSpec, load_engine_spec
from ..backends.trtllm.version import trtllm_available

log = logging.getLogger("trtllm_moespec.runtime")

BACKENDS = ("auto", "tensorrt_llm", "pytorch")


def choose_backend(requested: str, trtllm_ok: bool) -> str:
    """'tensorrt_llm' or 'pytorch' for a request of 'auto' | 'tensorrt_llm' | 'pytorch'."""
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}; choose one of {BACKENDS}")
    if requested == "tensorrt_llm" and not trtllm_ok:
        raise RuntimeError("backend 'tensorrt_llm' requested but tensorrt_llm is not importable on this machine")
    if requested == "auto":
        return "tensorrt_llm" if trtllm_ok else "pytorch"
    return requested


def pytorch_llm_kwargs(spec: EngineSpec, engine_dir: Path, device: str | None, dtype: str | None) -> dict[str, Any]:
    """Arguments of `trtllm_moespec.LLM` for an engine directory (tree left as a dict)."""
    if spec.checkpoint is None:
        raise ValueError(f"{engine_dir}/moespec.json has no target checkpoint; rebuild with --checkpoint")
    return {
        "model": spec.checkpoint,
        "draft_model": spec.draft_model,
        "policy": spec.policy,
        "tree": {"steps": spec.tree.steps, "topk": spec.tree.topk, "max_draft_tokens": spec.tree.max_draft_tokens},
        "device": device or "cpu",
        "dtype": dtype or spec.dtype,
        "cost_profile": str(engine_dir / spec.cost_profile) if spec.cost_profile else None,
        "predictor": spec.predictor,
    }


@dataclass(frozen=True)
class ExecutorStats:
    mean_accepted_tokens: float  # committed tokens per iteration, bonus included
    verified_tokens: float  # draft tokens verified per iteration
    num_steps: int  # speculative iterations


@dataclass(frozen=True)
class ExecutorOutput:
    """One completion from the TensorRT-LLM backend (the PyTorch engine returns its own outputs)."""

    text: str
    token_ids: list[int]
    stats: ExecutorStats


def acceptance_stats(num_tokens: int, accepted_draft_tokens: int, draft_tokens: int) -> ExecutorStats:
    """Our stats from TensorRT-LLM's per-request counters (each iteration emits 1 + accepted)."""
    steps = max(num_tokens - accepted_draft_tokens, 0)
    if steps == 0:
        return ExecutorStats(math.nan, math.nan, 0)
    return ExecutorStats(num_tokens / steps, draft_tokens / steps, steps)


class ExecutorBackend(Protocol):
    """What the Executor (and the Triton model through it) needs from a backend. The PyTorch
    engine and TensorRT-LLM each implement it; a batched engine can replace `_PytorchBackend`."""

    def generate(self, prompts: Sequence[str], params: Any) -> list[Any]: ...

    def stream(self, prompt: str, params: Any) -> Iterator[Any]: ...

    def shutdown(self) -> None: ...


def _pytorch_backend(spec: EngineSpec, engine_dir: Path, device: str | None, dtype: str | None, ep: Any,
                     max_batch_size: int) -> ExecutorBackend:
    """The PyTorch engine behind the Executor: the batched engine (`serve.backend.BatchedBackend`:
    concurrent calls share engine steps, each request's output identical to running it alone),
    or one request at a time where batching is not available (expert parallelism under mpirun,
    an analysis policy that needs the target's scores per request)."""
    import trtllm_moespec

    kwargs = pytorch_llm_kwargs(spec, engine_dir, device, dtype)
    kwargs["tree"] = trtllm_moespec.TreeConfig(**kwargs["tree"])
    llm = trtllm_moespec.LLM(**kwargs, ep=ep)
    if llm.batchable:
        from ..serve.backend import BatchedBackend

        return BatchedBackend(llm, max_batch_size)
    log.warning("MoESpec executor: %s; requests run one at a time",
                "expert-parallel engine" if ep is not None else f"policy {spec.policy} cannot run batched")
    return _PytorchBackend(llm)


class _PytorchBackend:
    """One request at a time on `trtllm_moespec.LLM` (where the batched engine cannot run)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def generate(self, prompts: Sequence[str], params: Any) -> list[Any]:
        return self.llm.generate(list(prompts), params)

    def stream(self, prompt: str, params: Any) -> Iterator[Any]:
        return self.llm.stream(prompt, params)

    def shutdown(self) -> None:
        pass


class TrtllmRunner:
    """Requests on a built `tensorrt_llm.LLM` through `generate_async`, so that concurrent calls (the Triton
    model's request threads) share TensorRT-LLM's in-flight batch, and streams are token by token.

    `generate_async(prompt, sampling_params, streaming)` returns a `GenerationResult`: `result()` waits for
    it, and iterating it yields it once per new response (tensorrt_llm/executor/result.py @
    a678b91aafbeff265cd0b764abb59d7def624ac2), its `outputs[0].text` / `token_ids` cumulative. TensorRT-LLM's
    own llmapi Triton model serves requests the same way (generate_async, one task per request:
    triton_backend/all_models/llmapi/tensorrt_llm/1/model.py @ 044a90d209e380c95e23e8ae42f3583fa05ada78).
    """

    batched = True  # concurrent callers share TensorRT-LLM's in-flight batch

    def __init__(self, llm: Any, sampling_params_cls: Any):
        self.llm, self._params_cls = llm, sampling_params_cls

    def _params(self, params: Any) -> Any:
        return self._params_cls(**trtllm_sampling_kwargs(params))

    def generate(self, prompts: Sequence[str], params: Any) -> list[ExecutorOutput]:
        trt_params = self._params(params)
        pending = [self.llm.generate_async(p, trt_params, streaming=False) for p in prompts]  # all in flight at once
        return [_executor_output(result.result().outputs[0]) for result in pending]

    def stream(self, prompt: str, params: Any) -> Iterator[Any]:
        """Events with the text (and token ids) each TensorRT-LLM response adds; the last carries the output."""
        from ..api import StreamEvent

        result = self.llm.generate_async(prompt, self._params(params), streaming=True)
        text_len = ids_len = 0
        completion = None
        for update in result:
            completion = update.outputs[0]
            text, ids = completion.text, list(completion.token_ids)
            if update.finished:
                break
            if len(text) > text_len or len(ids) > ids_len:
                yield StreamEvent(ids[ids_len:], text[text_len:])
                text_len, ids_len = len(text), len(ids)
        if completion is None:
            raise RuntimeError("TensorRT-LLM ended the stream without a response")
        ids = list(completion.token_ids)
        yield StreamEvent(ids[ids_len:], completion.text[text_len:], _executor_output(completion))

    def shutdown(self) -> None:
        self.llm.shutdown()


def _executor_output(completion: Any) -> ExecutorOutput:
    spec_metrics = getattr(getattr(completion, "request_perf_metrics", None), "speculative_decoding", None)
    accepted = getattr(spec_metrics, "total_accepted_draft_tokens", 0) or 0
    drafted = getattr(spec_metrics, "total_draft_tokens", 0) or 0
    ids = list(completion.token_ids)
    return ExecutorOutput(completion.text, ids, acceptance_stats(len(ids), accepted, drafted))


def _trtllm_backend(spec: EngineSpec, engine_dir: Path, profile: int | None, mpi_session: Any = None,
                    world_size: int = 1) -> TrtllmRunner:  # runs only where tensorrt_llm is installed (GPU machines)
    import yaml
    from tensorrt_llm import LLM
    from tensorrt_llm import SamplingParams as TrtllmSamplingParams
    from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

    from ..backends.trtllm.reach import install_for_engine, options_for_installed, prepare_process_model
    from ..backends.trtllm.version import check_effective_draft_tokens

    if spec.checkpoint is None:
        raise ValueError(f"{engine_dir}/moespec.json has no target checkpoint; rebuild with --checkpoint")
    process_model = prepare_process_model(world_size, spec.parallel.world_size, spec.mode)
    install_for_engine(spec, engine_dir)
    if process_model == "spawned-workers" and mpi_session is None:  # TensorRT-LLM spawns them: reach them too
        from ..backends.trtllm.reach import reaching_pool_session

        mpi_session = reaching_pool_session(spec.parallel.world_size, engine_dir)
    if spec.mode == "chain":
        log.warning("chain mode: TensorRT-LLM verifies the whole linear draft of the chosen profile")
    chosen = spec.profiles[-1] if profile is None else spec.profile(profile)
    options_path = spec.llm_api_options if profile is None else chosen.options_yaml
    options = options_for_installed(yaml.safe_load((engine_dir / options_path).read_text()), spec.mode)
    args = update_llm_args_with_extra_dict({"model": spec.checkpoint}, options)
    if mpi_session is not None:
        args["_mpi_session"] = mpi_session
    llm = LLM(**args)
    effective = getattr(getattr(llm, "args", None), "speculative_config", None)
    if effective is None:
        log.warning("cannot read the LLM's effective speculative_config; draft sizes not checked")
    else:
        check_effective_draft_tokens(effective, chosen.verify_length, chosen.max_draft_len)
    return TrtllmRunner(llm, TrtllmSamplingParams)


class Executor:
    """Run an engine directory; `generate(prompts, SamplingParams)` like `trtllm_moespec.LLM`."""

    def __init__(self, engine_dir: str | Path, backend: str = "auto", *, device: str | None = None,
                 dtype: str | None = None, profile: int | None = None, mpi_session: Any = None,
                 world_size: int = 1, ep: Any = None, max_batch_size: int = 8):
        """ep: rank 0's `parallel.run.EPContext` when the PyTorch engine runs expert-parallel under mpirun;
        max_batch_size: requests the PyTorch engine decodes together (concurrent calls share its steps)."""
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        self.engine_dir = Path(engine_dir)
        self.max_batch_size = max_batch_size  # requests a caller may run at once (the Triton model's thread pool)
        self.spec = load_engine_spec(self.engine_dir)
        self.backend = choose_backend(backend, trtllm_available())
        if self.backend == "tensorrt_llm":
            log.warning("MoESpec executor: running %s on TensorRT-LLM (policy %s, %s mode)",
                        self.engine_dir, self.spec.policy, self.spec.mode)
            self._impl: ExecutorBackend = _trtllm_backend(self.spec, self.engine_dir, profile, mpi_session, world_size)
        else:
            log.warning("MoESpec executor: tensorrt_llm is not available; running %s on the PyTorch engine "
                        "(trtllm_moespec.LLM, policy %s, device %s)", self.engine_dir, self.spec.policy, device or "cpu")
            self._impl = _pytorch_backend(self.spec, self.engine_dir, device, dtype, ep, max_batch_size)

    @property
    def batched(self) -> bool:
        """Do concurrent calls share engine steps (the PyTorch engine's continuous batch)? Callers
        such as the Triton model then run their requests concurrently instead of one by one."""
        return getattr(self._impl, "batched", False)

    def generate(self, prompts: str | Sequence[str], sampling_params: Any = None) -> list[Any]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if sampling_params is None:
            from .. import SamplingParams

            sampling_params = SamplingParams()
        return self._impl.generate(prompts, sampling_params)

    def stream(self, prompt: str, sampling_params: Any = None) -> Iterator[Any]:
        """Stream one prompt: events with `.text` chunks, the last one carrying `.output`."""
        if sampling_params is None:
            from .. import SamplingParams

            sampling_params = SamplingParams()
        return self._impl.stream(prompt, sampling_params)

    def shutdown(self) -> None:
        self._impl.shutdown()


def trtllm_sampling_kwargs(params: Any) -> dict:
    """Our SamplingParams -> keywords of TensorRT-LLM's `SamplingParams` (tensorrt_llm/sampling_params.py
    @ a98a9061d72f6fd39f5d055ebdd2c6878a100e2c), where None means the C++ runtime's default: top_k 0 (off), repetition penalty 1,
    presence and frequency penalties 0, min_p 0, min_tokens 1. Values at their "off" value go as None;
    `stop`, `include_stop_str_in_output`, `ignore_eos` and `skip_special_tokens` have keywords of the same
    names and meaning, and `bad_words` is its `bad` ("strings that redirect the generation"). A logit
    bias and allowed token ids have no keyword there (only a [vocab] `embedding_bias` tensor),
    structured output needs the LLM built with a guided-decoding backend, and logprobs are not read
    back from its outputs here: all refused rather than silently dropped."""
    for name in ("logit_bias", "structured", "allowed_token_ids", "logprobs", "prompt_logprobs"):
        if getattr(params, name) not in (None, ()):  # (logprobs=0 asks for logprobs: only None is off)
            raise ValueError(f"{name} is not supported by the TensorRT-LLM backend; use the PyTorch engine")

    def unless(value: float, off: float) -> float | None:
        return None if value == off else value

    return dict(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k or None, seed=params.seed, stop=params.stop, return_perf_metrics=True,
                include_stop_str_in_output=params.include_stop_str_in_output, ignore_eos=params.ignore_eos,
                skip_special_tokens=params.skip_special_tokens, bad=list(params.bad_words) if params.bad_words else None,
                repetition_penalty=unless(params.repetition_penalty, 1.0),
                presence_penalty=unless(params.presence_penalty, 0.0),
                frequency_penalty=unless(params.frequency_penalty, 0.0),
                min_p=unless(params.min_p, 0.0), min_tokens=params.min_tokens or None,
                stop_token_ids=list(params.stop_token_ids) if params.stop_token_ids else None)
