"""Triton Inference Server python-backend model over the MoESpec Executor.

Tensor names follow TensorRT-LLM's own `llmapi` Triton model
(triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt @ 0a71057313ec0626527e164a8fc0205c5822e2f5):
inputs `text_input`, `streaming`,
`sampling_param_{max_tokens,temperature,top_p,top_k,seed,stop,frequency_penalty,presence_penalty}`
(it has no repetition penalty); outputs `text_output`, `acceptance_rate`,
`total_accepted_draft_tokens`, `total_draft_tokens`, plus ours: `mean_accepted_tokens`,
`verified_tokens`. Settings come from `model.yaml` beside the generated `model.py` (engine_dir,
backend, device, dtype, and the `triton_config` block with max_batch_size and decoupled);
config.pbtxt carries the same two settings, so the server may run with or without
auto-complete (`--disable-auto-complete-config`, as TensorRT-LLM's launch scripts pass).

Launch: one `tritonserver` per model repository, as TensorRT-LLM's llmapi model now expects
(its stub deletes the inherited MPI job variables at import and lets TensorRT-LLM spawn the
other ranks' workers, model.py @ 044a90d209e380c95e23e8ae42f3583fa05ada78); ours does the same (`forget_mpi_launch`) and
refuses to start as one of several mpirun ranks.

Request parsing and response building are plain functions taking the
`triton_python_backend_utils` module as an argument, so tests run them with a
stand-in. In decoupled mode execute() returns at once and each request runs on a
request thread (`generate_async` underneath on TensorRT-LLM, the continuous batch on our
engine): a streaming request gets one response per committed chunk, then a final one
(full text, statistics, final flag). Inputs are checked by dtype and shape: a wrong dtype,
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


# MPI job variables a process started by mpirun inherits (TensorRT-LLM's llmapi Triton model deletes the same
# ones at import: triton_backend/all_models/llmapi/tensorrt_llm/1/model.py @ 044a90d209e380c95e23e8ae42f3583fa05ada78).
MPI_JOB_ENV = frozenset({
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_NODE_RANK", "OMPI_UNIVERSE_SIZE", "OMPI_FIRST_RANKS", "OMPI_APP_CTX_NUM_PROCS", "PMIX_RANK",
    "PMIX_NAMESPACE", "PMIX_SERVER_URI", "PMIX_SERVER_URI2", "PMIX_SERVER_URI21", "PMIX_SERVER_URI3",
    "PMIX_SERVER_TMPDIR", "PMIX_SYSTEM_TMPDIR", "PMIX_SECURITY_MODE", "PMIX_GDS_MODULE", "PMIX_BFROPS_MODULE",
    "PMIX_PTL_MODULE", "PMIX_VERSION", "PMIX_HOSTNAME", "PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_SPAWNED", "PMI_APPNUM",
})
MPI_JOB_PREFIXES = ("OMPI_MCA_orte_", "ORTE_")


def forget_mpi_launch(environ: Any = None) -> int:
    """Delete inherited MPI job variables, as TensorRT-LLM's llmapi stub does; returns the world size they named.

    The supported launch is one `tritonserver` process: its python-backend stub builds the LLM and TensorRT-LLM
    spawns the other ranks' workers (the Executor hands it a session that installs our worker there). A stub of a
    server started under mpirun would otherwise initialise MPI with its parent's job identity.
    """
    environ = os.environ if environ is None else environ
    size = next((int(environ[k]) for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE") if k in environ), 1)
    for key in [k for k in environ if k in MPI_JOB_ENV or k.startswith(MPI_JOB_PREFIXES)]:
        del environ[key]
    return size


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

    One tritonserver serves the repository (see forget_mpi_launch): the stub builds the Executor, which on
    TensorRT-LLM spawns the other GPUs' workers itself. In decoupled mode execute() hands each request to a
    pool of request threads and returns at once, so requests that arrive later join the ones in flight
    (TensorRT-LLM's in-flight batch, or our PyTorch engine's continuous batch); each is answered from its
    thread as it finishes. Without decoupling Triton needs the responses from execute(), which therefore
    waits for its batch.
    """
    model_yaml = Path(model_yaml)
    inherited_world = forget_mpi_launch()

    class TritonPythonModel:
        @classmethod
        def auto_complete_config(cls, auto_complete_model_config):
            triton = load_model_yaml(model_config_path(model_yaml))["triton_config"]
            auto_complete_model_config.set_model_transaction_policy(dict(decoupled=bool(triton["decoupled"])))
            auto_complete_model_config.set_max_batch_size(int(triton["max_batch_size"]))
            return auto_complete_model_config

        def initialize(self, args: dict[str, Any]) -> None:
            from .executor import Executor

            if inherited_world > 1:
                raise ValueError(f"tritonserver was started as one of {inherited_world} MPI ranks: start one "
                                 "`tritonserver --model-repository ...` (TensorRT-LLM spawns the other GPUs' workers)")
            config = load_model_yaml(model_config_path(model_yaml))
            self.decoupled = bool(config["triton_config"]["decoupled"])
            self.executor = Executor(config["engine_dir"], config.get("backend", "auto"), device=config.get("device"),
                                     dtype=config.get("dtype"), max_batch_size=_engine_batch_size(config))

        def _sampling(self, params: RequestParams) -> Any:
            from .. import SamplingParams

            return SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                                  top_k=params.top_k, seed=params.seed, stop=params.stop or None,
                                  frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty)

        def _generate(self, params: RequestParams) -> Any:
            return self.executor.generate([params.prompt], self._sampling(params))[0]

        def _stream(self, params: RequestParams) -> Any:
            return self.executor.stream(params.prompt, self._sampling(params))

        def _request_threads(self) -> Any:
            """The persistent pool decoupled requests run on: as wide as the executor batches, else one."""
            if getattr(self, "_pool", None) is None:
                from concurrent.futures import ThreadPoolExecutor

                executor = getattr(self, "executor", None)
                width = executor.max_batch_size if executor is not None and executor.batched else 1
                self._pool = ThreadPoolExecutor(max(width, 1), thread_name_prefix="moespec-triton")
            return self._pool

        def execute(self, requests: list[Any]) -> list[Any] | None:
            import triton_python_backend_utils as pb_utils

            if not self.decoupled:
                return self._each(requests, lambda r: handle_request(pb_utils, r, self._generate))
            pool = self._request_threads()
            for request in requests:  # answered from the pool as each finishes; execute returns now
                self._in_flight.add(pool.submit(serve_decoupled, pb_utils, request, self._stream))
            return None

        @property
        def _in_flight(self) -> set:
            if getattr(self, "_futures", None) is None:
                self._futures = set()
            self._futures = {f for f in self._futures if not f.done()}
            return self._futures

        def wait_idle(self, timeout: float | None = None) -> None:
            """Wait until every decoupled request handed to the pool has been answered."""
            from concurrent.futures import wait

            wait(list(self._in_flight), timeout=timeout)

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
            if getattr(self, "_pool", None) is not None:
                self._pool.shutdown(wait=True)  # requests in flight are answered first
                self._pool = None
            if getattr(self, "executor", None) is not None:
                self.executor.shutdown()

    return TritonPythonModel


