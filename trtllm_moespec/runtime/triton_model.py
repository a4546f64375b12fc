"""Triton Inference Server python-backend model over the MoESpec Executor.

Tensor names follow TensorRT-LLM's own `llmapi` Triton model
(triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt): inputs `text_input`,
`streaming`, `sampling_param_{max_tokens,temperature,top_p,top_k,seed,stop}`;
outputs `text_output`, `acceptance_rate`, `total_accepted_draft_tokens`,
`total_draft_tokens`, plus ours: `mean_accepted_tokens`, `verified_tokens`.
Settings come from `model.yaml` beside the generated `model.py` (engine_dir,
backend, device, dtype, and the `triton_config` block with max_batch_size and
decoupled, applied in auto_complete_config as TensorRT-LLM does).

Request parsing and response building are plain functions taking the
`triton_python_backend_utils` module as an argument, so tests run them with a
stand-in. Our engine has no token streaming yet: a streaming request gets its
whole completion in one final response.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import yaml

# (input name, dtype it is read as, RequestParams field, default)
SCALAR_INPUTS = (
    ("sampling_param_max_tokens", int, "max_tokens", 64),
    ("sampling_param_temperature", float, "temperature", 0.0),
    ("sampling_param_top_p", float, "top_p", 1.0),
    ("sampling_param_top_k", int, "top_k", 0),
    ("sampling_param_seed", int, "seed", None),
    ("streaming", bool, "streaming", False),
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


@dataclass(frozen=True)
class ResponseStats:
    mean_accepted_tokens: float  # committed tokens per iteration, bonus included (NaN if unknown)
    verified_tokens: float  # draft tokens verified per iteration
    total_accepted_draft_tokens: int
    total_draft_tokens: int
    acceptance_rate: float  # accepted / drafted draft tokens


def _strings(array: np.ndarray) -> list[str]:
    return [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in array.reshape(-1)]


def _scalar(pb_utils: Any, request: Any, name: str, cast: type) -> Any:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    array = tensor.as_numpy()
    if array.size != 1:
        raise pb_utils.TritonModelException(f"input {name} must hold one value, got shape {array.shape}")
    return cast(array.reshape(-1)[0].item())


def parse_request(pb_utils: Any, request: Any) -> RequestParams:
    """RequestParams from a Triton request; TritonModelException on malformed input."""
    text = pb_utils.get_input_tensor_by_name(request, "text_input")
    if text is None:
        raise pb_utils.TritonModelException("request has no text_input")
    prompts = _strings(text.as_numpy())
    if len(prompts) != 1:
        raise pb_utils.TritonModelException(f"text_input must hold one prompt (no batching), got {len(prompts)}")
    values: dict[str, Any] = {"prompt": prompts[0]}
    for name, cast, key, _default in SCALAR_INPUTS:
        value = _scalar(pb_utils, request, name, cast)
        if value is not None:
            values[key] = value
    stop = pb_utils.get_input_tensor_by_name(request, "sampling_param_stop")
    if stop is not None:
        values["stop"] = _strings(stop.as_numpy())
    params = RequestParams(**values)
    if params.max_tokens < 1 or params.temperature < 0 or not 0 < params.top_p <= 1:
        raise pb_utils.TritonModelException(
            f"bad sampling parameters: max_tokens={params.max_tokens}, temperature={params.temperature}, top_p={params.top_p}")
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
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"{type(e).__name__}: {e}"))


def load_model_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; regenerate the repository with `moespec triton-repo`")
    data = yaml.safe_load(path.read_text()) or {}
    if "engine_dir" not in data or "triton_config" not in data:
        raise ValueError(f"{path} needs engine_dir and triton_config")
    return data


def make_triton_model(model_yaml: str | Path) -> type:
    """The TritonPythonModel class for a repository whose model.yaml is `model_yaml`."""
    model_yaml = Path(model_yaml)

    class TritonPythonModel:
        @classmethod
        def auto_complete_config(cls, auto_complete_model_config):
            triton = load_model_yaml(model_yaml)["triton_config"]
            auto_complete_model_config.set_model_transaction_policy(dict(decoupled=bool(triton["decoupled"])))
            auto_complete_model_config.set_max_batch_size(int(triton["max_batch_size"]))
            return auto_complete_model_config

        def initialize(self, args: dict[str, Any]) -> None:
            from .executor import Executor

            config = load_model_yaml(model_yaml)
            self.decoupled = bool(config["triton_config"]["decoupled"])
            self.executor = Executor(config["engine_dir"], config.get("backend", "auto"),
                                     device=config.get("device"), dtype=config.get("dtype"))

        def _generate(self, params: RequestParams) -> Any:
            from .. import SamplingParams

            sampling = SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                                      top_k=params.top_k, seed=params.seed, stop=params.stop or None)
            return self.executor.generate([params.prompt], sampling)[0]

        def execute(self, requests: list[Any]) -> list[Any] | None:
            import triton_python_backend_utils as pb_utils

            responses = [handle_request(pb_utils, r, self._generate) for r in requests]
            if not self.decoupled:
                return responses
            for request, response in zip(requests, responses):
                request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None

        def finalize(self) -> None:
            self.executor.shutdown()

    return TritonPythonModel
