"""Triton Inference Server python-backend model over the MoESpec Executor.

Tensor names follow TensorRT-LLM's own `llmapi` Triton model
(triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt): inputs `text_input`,
`streaming`, `sampling_param_{max_tokens,temperature,top_p,top_k,seed,stop,frequency_penalty,presence_penalty}`
(config.pbtxt @ 0a710573; it has no repetition penalty);
outputs `text_output`, `acceptance_rate`, `total_accepted_draft_tokens`,
`total_draft_tokens`, plus ours: `mean_accepted_tokens`, `verified_tokens`.
Settings come from `model.yaml` beside the generated `model.py` (engine_dir,
backend, device, dtype, and the `triton_config` block with max_batch_size and
decoupled, applied in auto_complete_config as TensorRT-LLM does).

Request parsing and response building are plain functions taking the
`triton_python_backend_utils` module as an argument, so tests run them with a
stand-in. In decoupled mode a streaming request gets one response per committed
chunk and then a final one (full text, statistics, final flag); every request is
answered as soon as it finishes. Inputs are checked by dtype and shape: a wrong dtype,
a BYTES scalar, bad UTF-8, NaN or an empty string gets one error response.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import yaml

from ..core.logit_rules import LogitRules

# (input name, numpy dtype kind accepted, Python type, RequestParams field). Kinds: "iu" integers,
# "f" floats, "b" bool. A wrong dtype is an error (never coerced: FP32 5.9 is not 5 tokens).
SCALAR_INPUTS = (
    ("sampling_param_max_tokens", "iu", int, "max_tokens"),
    ("sampling_param_temperature", "f", float, "temperature"),
    ("sampling_param_top_p", "f", float, "top_p"),
    ("sampling_param_top_k", "iu", int, "top_k"),
    ("sampling_param_seed", "iu", int, "seed"),
    ("sampling_param_frequency_penalty", "f", float, "frequency_penalty"),
    ("sampling_param_presence_penalty", "f", float, "presence_penalty"),
    ("streaming", "b", bool, "streaming"),
)
OUTPUTS = (
    ("text_output", "TYPE_STRING"),
    ("acceptance_rate", "TYPE_FP32"),
    ("total_accepted_draft_tokens", "TYPE_INT32"),
    ("total_draft_tokens", "TYPE_INT32"),
    ("mean_accepted_tokens", "TYPE_FP32"),
    ("verified_tokens", "TYPE_FP32"),
)


@dataclass(frozen=True)
class RequestParams:
    prompt: str
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    streaming: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0


@dataclass(frozen=True)
class ResponseStats:
    mean_accepted_tokens: float  # committed tokens per iteration, bonus included (NaN if unknown)
    verified_tokens: float  # draft tokens verified per iteration
    total_accepted_draft_tokens: int
    total_draft_tokens: int
    acceptance_rate: float  # accepted / drafted draft tokens


def _strings(pb_utils: Any, name: str, array: np.ndarray) -> list[str]:
    """UTF-8 strings of a BYTES tensor; TritonModelException for another dtype, bad UTF-8 or empty strings."""
    if array.dtype.kind not in "OSU":
        raise pb_utils.TritonModelException(f"input {name} must be BYTES (TYPE_STRING), got dtype {array.dtype}")
    values = []
    for x in array.reshape(-1):
        if isinstance(x, bytes):
            try:
                x = x.decode("utf-8")
            except UnicodeDecodeError as e:
                raise pb_utils.TritonModelException(f"input {name} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        elif not isinstance(x, str):
            raise pb_utils.TritonModelException(f"input {name} must hold strings, got {type(x).__name__}")
        if x == "":
            raise pb_utils.TritonModelException(f"input {name} holds an empty string")
        values.append(x)
    return values


def _scalar(pb_utils: Any, request: Any, name: str, kinds: str, cast: type) -> Any:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    array = tensor.as_numpy()
    if array.size != 1:
        raise pb_utils.TritonModelException(f"input {name} must hold one value, got shape {array.shape}")
    if array.dtype.kind not in kinds:
        wanted = {"iu": "an integer", "f": "a floating-point", "b": "a BOOL"}[kinds]
        raise pb_utils.TritonModelException(f"input {name} must be {wanted} tensor, got dtype {array.dtype}")
    value = cast(array.reshape(-1)[0].item())
    if isinstance(value, float) and not math.isfinite(value):
        raise pb_utils.TritonModelException(f"input {name} must be finite, got {value}")
    return value


def parse_request(pb_utils: Any, request: Any) -> RequestParams:
    """RequestParams from a Triton request; TritonModelException (one line) on malformed input."""
    text = pb_utils.get_input_tensor_by_name(request, "text_input")
    if text is None:
        raise pb_utils.TritonModelException("request has no text_input")
    prompts = _strings(pb_utils, "text_input", text.as_numpy())
    if len(prompts) != 1:
        raise pb_utils.TritonModelException(f"text_input must hold one prompt (no batching), got {len(prompts)}")
    values: dict[str, Any] = {"prompt": prompts[0]}
    for name, kinds, cast, key in SCALAR_INPUTS:
        value = _scalar(pb_utils, request, name, kinds, cast)
        if value is not None:
            values[key] = value
    stop = pb_utils.get_input_tensor_by_name(request, "sampling_param_stop")
    if stop is not None:
        values["stop"] = _strings(pb_utils, "sampling_param_stop", stop.as_numpy())
    params = RequestParams(**values)
    if params.max_tokens < 1 or params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0:
        raise pb_utils.TritonModelException(
            f"bad sampling parameters: max_tokens={params.max_tokens}, temperature={params.temperature}, "
            f"top_p={params.top_p}, top_k={params.top_k}")
    try:
        LogitRules(presence=params.presence_penalty, frequency=params.frequency_penalty)
    except ValueError as e:
        raise pb_utils.TritonModelException(f"bad sampling parameters: {e}") from None
    return params


def response_stats(output: Any) -> ResponseStats:
    """Acceptance statistics of one completion (our engine's or the Executor's stats)."""
    stats = getattr(output, "stats", None)
    mat = float(getattr(stats, "mean_accepted_tokens", math.nan) or math.nan)
    verified = float(getattr(stats, "verified_tokens", math.nan) or math.nan)
    n = len(getattr(output, "token_ids", []) or [])
    if not (mat > 0 and math.isfinite(mat) and math.isfinite(verified)):
        return ResponseStats(mat, verified, 0, 0, math.nan)
    steps = n / mat
    accepted = int(round(n - steps))
    drafted = int(round(verified * steps))
    return ResponseStats(mat, verified, accepted, drafted, accepted / drafted if drafted else math.nan)


def text_response(pb_utils: Any, text: str) -> Any:
    """A streamed chunk: text_output only."""
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))])


def error_response(pb_utils: Any, error: Exception) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"{type(error).__name__}: {error}"))


def build_response(pb_utils: Any, output: Any) -> Any:
    """An InferenceResponse with text_output and the acceptance statistics."""
    s = response_stats(output)
    tensors = [
        pb_utils.Tensor("text_output", np.array([output.text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("acceptance_rate", np.array([s.acceptance_rate], dtype=np.float32)),
        pb_utils.Tensor("total_accepted_draft_tokens", np.array([s.total_accepted_draft_tokens], dtype=np.int32)),
        pb_utils.Tensor("total_draft_tokens", np.array([s.total_draft_tokens], dtype=np.int32)),
        pb_utils.Tensor("mean_accepted_tokens", np.array([s.mean_accepted_tokens], dtype=np.float32)),
        pb_utils.Tensor("verified_tokens", np.array([s.verified_tokens], dtype=np.float32)),
    ]
    return pb_utils.InferenceResponse(output_tensors=tensors)


def handle_request(pb_utils: Any, request: Any, generate: Callable[[RequestParams], Any]) -> Any:
    """Parse, generate, respond; errors become an error response instead of killing the model."""
    try:
        return build_response(pb_utils, generate(parse_request(pb_utils, request)))
    except Exception as e:  # noqa: BLE001 - every failure must reach the client as a response
        return error_response(pb_utils, e)


def serve_decoupled(pb_utils: Any, request: Any, stream: Callable[[RequestParams], Any]) -> None:
    """Decoupled mode, one request: a response per committed chunk when streaming, then the final
    response (full text and statistics) with the final flag; errors become one final error response."""
    sender = request.get_response_sender()
    final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    try:
        params = parse_request(pb_utils, request)
        output = None
        for event in stream(params):
            # The last event may carry text too (a multi-byte character held back until complete):
            # streamed chunks, joined, must equal the final text.
            if params.streaming and event.text:
                sender.send(text_response(pb_utils, event.text))
            if event.output is not None:
                output = event.output
        if output is None:
            raise RuntimeError("the engine ended the stream without a final output")
        sender.send(build_response(pb_utils, output), flags=final)
    except Exception as e:  # noqa: BLE001 - every failure must reach the client as a response
        sender.send(error_response(pb_utils, e), flags=final)


def mpi_rank_and_size() -> tuple[int, int]:
    """(rank, size) of the MPI world Triton was started in (mpi4py when present, else (0, 1))."""
    try:
        from mpi4py import MPI
    except ImportError:
        return 0, 1
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def model_config_path(default: str | Path) -> Path:
    """The model.yaml to read: $LLM_CONFIG_PATH (relative to the model version directory) if set, as
    TensorRT-LLM's llmapi Triton model does, else `default`."""
    override = os.environ.get("LLM_CONFIG_PATH")
    return Path(default) if not override else Path(default).parent / override


def load_model_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; regenerate the repository with `moespec triton-repo`")
    data = yaml.safe_load(path.read_text()) or {}
    if "engine_dir" not in data or "triton_config" not in data:
        raise ValueError(f"{path} needs engine_dir and triton_config")
    return data


def _engine_batch_size(config: dict[str, Any]) -> int:
    """Requests the PyTorch engine decodes together: Triton's max_batch_size, or 8 where it is 0
    (Triton's 0 means no batch dimension in the tensors, not one request at a time)."""
    size = int(config["triton_config"]["max_batch_size"])
    if size < 0:
        raise ValueError(f"triton_config.max_batch_size must be >= 0, got {size}")
    return size or 8


def make_triton_model(model_yaml: str | Path) -> type:
    """The TritonPythonModel class for a repository whose model.yaml is `model_yaml`.

    Under mpirun (the Triton server started on every rank, as for TensorRT-LLM's llmapi
    model) rank 0 builds the Executor with an `MpiCommSession` over COMM_WORLD, and
    every other rank installs the MoESpec worker and serves `MPICommExecutor`.
    """
    model_yaml = Path(model_yaml)

    class TritonPythonModel:
        @classmethod
        def auto_complete_config(cls, auto_complete_model_config):
            triton = load_model_yaml(model_config_path(model_yaml))["triton_config"]
            auto_complete_model_config.set_model_transaction_policy(dict(decoupled=bool(triton["decoupled"])))
            auto_complete_model_config.set_max_batch_size(int(triton["max_batch_size"]))
            return auto_complete_model_config

        def initialize(self, args: dict[str, Any]) -> None:
            from .executor import Executor

            config = load_model_yaml(model_config_path(model_yaml))
            self.decoupled = bool(config["triton_config"]["decoupled"])
            rank, size = mpi_rank_and_size()
            backend = config.get("backend", "auto")
            self.executor = None
            if size > 1 and rank != 0:
                from ..backends.trtllm.version import trtllm_available

                if trtllm_available() and backend != "pytorch":
                    serve_worker_rank(config["engine_dir"], rank)
                return  # the PyTorch engine runs on rank 0 only
            session = leader_mpi_session(size) if size > 1 else None
            self.executor = Executor(config["engine_dir"], backend, device=config.get("device"),
                                     dtype=config.get("dtype"), mpi_session=session, world_size=size,
                                     max_batch_size=_engine_batch_size(config))

        def _sampling(self, params: RequestParams) -> Any:
            from .. import SamplingParams

            return SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                                  top_k=params.top_k, seed=params.seed, stop=params.stop or None,
                                  frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty)

        def _generate(self, params: RequestParams) -> Any:
            return self.executor.generate([params.prompt], self._sampling(params))[0]

        def _stream(self, params: RequestParams) -> Any:
            return self.executor.stream(params.prompt, self._sampling(params))

        def execute(self, requests: list[Any]) -> list[Any] | None:
            import triton_python_backend_utils as pb_utils

            if not self.decoupled:
                return self._each(requests, lambda r: handle_request(pb_utils, r, self._generate))
            self._each(requests, lambda r: serve_decoupled(pb_utils, r, self._stream))  # each answered when it finishes
            return None

        def _each(self, requests: list[Any], handle: Callable[[Any], Any]) -> list[Any]:
            """handle(request) for each request, in order; concurrently (one thread per request) when the
            executor batches, so Triton's batch of requests shares the engine's steps."""
            executor = getattr(self, "executor", None)
            if executor is None or not executor.batched or len(requests) < 2:
                return [handle(r) for r in requests]
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(requests), thread_name_prefix="moespec-triton") as pool:
                return list(pool.map(handle, requests))

        def finalize(self) -> None:
            if self.executor is not None:
                self.executor.shutdown()

    return TritonPythonModel


def serve_worker_rank(engine_dir: str, rank: int) -> None:  # GPU machines (TensorRT-LLM) only
    """A non-leader rank: install the worker (the leader's patch does not reach this process), then serve."""
    from mpi4py.futures import MPICommExecutor
    from mpi4py.MPI import COMM_WORLD

    from ..backends.trtllm.config import load_engine_spec
    from ..backends.trtllm.reach import install_for_engine

    install_for_engine(load_engine_spec(engine_dir), engine_dir)
    with MPICommExecutor(COMM_WORLD) as executor:
        if executor is not None:
            raise RuntimeError(f"rank {rank} unexpectedly became the MPI executor root")


def leader_mpi_session(size: int) -> Any:  # GPU machines (TensorRT-LLM) only
    from mpi4py.MPI import COMM_WORLD
    from tensorrt_llm.llmapi import MpiCommSession

    return MpiCommSession(comm=COMM_WORLD, n_workers=size)
