"""Triton model repository: generated files, and request handling through a stand-in pb_utils."""

import importlib.util
import math
import sys

import numpy as np
import pytest
import yaml

from tests.runtime import pb_utils_standin as pb
from trtllm_moespec.backends.trtllm.schema import TRITON_CONFIG_FIELDS, TRITON_LLMAPI_INPUTS, TRITON_LLMAPI_OUTPUTS
from trtllm_moespec.runtime.executor import ExecutorOutput, ExecutorStats
from trtllm_moespec.runtime.triton_model import handle_request, parse_request, response_stats
from trtllm_moespec.runtime.triton_repo import main as triton_repo_main


def _request(**inputs):
    defaults = {"text_input": np.array([b"def f(x):"], dtype=np.object_)}
    return pb.InferenceRequest({**defaults, **inputs})


def _output(text="    return x", n=12, mat=3.0, verified=8.0):
    return ExecutorOutput(text, list(range(n)), ExecutorStats(mat, verified, int(n / mat)))


def test_repository_files(engine_dir, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert triton_repo_main(["--engine-dir", str(engine_dir), "--out", str(repo), "--decoupled"]) == 0
    assert "has not run" in capsys.readouterr().out
    pbtxt = (repo / "moespec" / "config.pbtxt").read_text()
    assert 'backend: "python"' in pbtxt
    # F6: complete without auto-complete (--disable-auto-complete-config): the settings model.yaml carries
    assert "max_batch_size: 0" in pbtxt and "model_transaction_policy {\n  decoupled: true\n}" in pbtxt
    names = set(__import__("re").findall(r'name: "([a-z_]+)"', pbtxt)) - {"moespec"}
    assert TRITON_LLMAPI_INPUTS <= names and TRITON_LLMAPI_OUTPUTS <= names
    assert {"mean_accepted_tokens", "verified_tokens"} <= names
    config = yaml.safe_load((repo / "moespec" / "1" / "model.yaml").read_text())
    assert set(config["triton_config"]) == TRITON_CONFIG_FIELDS and config["triton_config"]["decoupled"] is True
    assert config["engine_dir"] == str(engine_dir.resolve())
    assert "has not run this repository here" in (repo / "README.md").read_text()

    # The generated model.py loads and applies model.yaml's triton_config.
    spec = importlib.util.spec_from_file_location("moespec_triton_model", repo / "moespec" / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.TritonPythonModel.auto_complete_config(pb.AutoCompleteConfig())
    assert cfg.policy == {"decoupled": True} and cfg.max_batch_size == 0


def test_triton_repo_rejects_a_missing_engine(tmp_path, capsys):
    assert triton_repo_main(["--engine-dir", str(tmp_path / "none"), "--out", str(tmp_path / "r")]) == 2
    assert "moespec.json" in capsys.readouterr().err


def test_parse_request_reads_llmapi_tensor_names():
    req = _request(
        sampling_param_max_tokens=np.array([5], dtype=np.int32),
        sampling_param_temperature=np.array([0.7], dtype=np.float32),
        sampling_param_top_p=np.array([0.9], dtype=np.float32),
        sampling_param_seed=np.array([42], dtype=np.uint64),
        sampling_param_stop=np.array([b"\n\n", b"END"], dtype=np.object_),
        sampling_param_presence_penalty=np.array([0.5], dtype=np.float32),
        streaming=np.array([True]),
    )
    p = parse_request(pb, req)
    assert (p.prompt, p.max_tokens, p.top_k, p.seed, p.stop, p.streaming) == ("def f(x):", 5, 0, 42, ["\n\n", "END"], True)
    assert p.temperature == pytest.approx(0.7) and p.top_p == pytest.approx(0.9)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, 0.0)


@pytest.mark.parametrize(
    "inputs,message",
    [
        ({"text_input": None}, "no text_input"),
        ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "one prompt"),
        ({"sampling_param_max_tokens": np.array([1, 2], dtype=np.int32)}, "one value"),
        ({"sampling_param_max_tokens": np.array([0], dtype=np.int32)}, "bad sampling parameters"),
        ({"sampling_param_top_p": np.array([0.0], dtype=np.float32)}, "bad sampling parameters"),
        # issue 11 item 7: wrong dtypes are errors, never coerced
        ({"text_input": np.array([5], dtype=np.int32)}, "text_input must be BYTES"),
        ({"sampling_param_max_tokens": np.array([5.9], dtype=np.float32)}, "must be an integer tensor"),
        ({"sampling_param_max_tokens": np.array([b"5"], dtype=np.object_)}, "must be an integer tensor"),
        ({"sampling_param_temperature": np.array([b"0.5"], dtype=np.object_)}, "must be a floating-point tensor"),
        ({"sampling_param_temperature": np.array([1], dtype=np.int32)}, "must be a floating-point tensor"),
        ({"streaming": np.array([1], dtype=np.int32)}, "must be a BOOL tensor"),
        ({"text_input": np.array([b"\xff\xfe bad"], dtype=np.object_)}, "not valid UTF-8"),
        ({"sampling_param_stop": np.array([b"ok", b"\xc3"], dtype=np.object_)}, "sampling_param_stop is not valid UTF-8"),
        ({"sampling_param_temperature": np.array([np.nan], dtype=np.float32)}, "must be finite"),
        ({"sampling_param_top_p": np.array([np.inf], dtype=np.float32)}, "must be finite"),
        ({"text_input": np.array([b""], dtype=np.object_)}, "text_input holds an empty string"),
        ({"sampling_param_stop": np.array([b""], dtype=np.object_)}, "sampling_param_stop holds an empty string"),
        ({"sampling_param_top_k": np.array([-1], dtype=np.int32)}, "bad sampling parameters"),
        ({"sampling_param_frequency_penalty": np.array([3.0], dtype=np.float32)}, "frequency_penalty must be"),
    ],
)
def test_malformed_requests_become_error_responses(inputs, message):
    req = _request(**inputs)
    if inputs.get("text_input", 0) is None:
        del req.inputs["text_input"]
    response = handle_request(pb, req, lambda params: _output())
    assert response.error is not None and message in response.error.message() and response.output_tensors == []


def test_response_carries_text_and_acceptance_stats():
    response = handle_request(pb, _request(), lambda params: _output(n=12, mat=3.0, verified=8.0))
    assert response.error is None
    assert response.tensor("text_output")[0] == b"    return x"
    assert response.tensor("mean_accepted_tokens")[0] == pytest.approx(3.0)
    assert response.tensor("verified_tokens")[0] == pytest.approx(8.0)
    # 12 tokens at 3 per iteration = 4 iterations: 8 accepted draft tokens of 32 verified.
    assert response.tensor("total_accepted_draft_tokens")[0] == 8 and response.tensor("total_draft_tokens")[0] == 32
    assert response.tensor("acceptance_rate")[0] == pytest.approx(0.25)
    assert math.isnan(response_stats(ExecutorOutput("", [], ExecutorStats(math.nan, math.nan, 0))).acceptance_rate)


class _Event:
    def __init__(self, text="", output=None):
        self.text, self.output = text, output


def _load_model(engine_dir, tmp_path, monkeypatch, name, decoupled=True):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    repo = tmp_path / name
    args = ["--engine-dir", str(engine_dir), "--out", str(repo)] + (["--decoupled"] if decoupled else [])
    assert triton_repo_main(args) == 0
    spec = importlib.util.spec_from_file_location(f"moespec_{name}", repo / "moespec" / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, repo


def test_decoupled_streams_chunks_and_answers_each_request_when_it_finishes(engine_dir, tmp_path, monkeypatch):
    module, _ = _load_model(engine_dir, tmp_path, monkeypatch, "stream")
    model = module.TritonPythonModel()
    model.decoupled = True
    requests = [_request(streaming=np.array([True])), _request(text_input=np.array([b"abc"], dtype=np.object_)),
                _request(sampling_param_max_tokens=np.array([1.5], dtype=np.float32))]
    seen = []

    def stream(params):
        # when the second request starts, the first has already been answered in full
        seen.append([len(r.sender.sent) for r in requests])
        yield _Event(" one")
        yield _Event(" two")
        yield _Event(" \u2713", output=_output(text=params.prompt + " one two \u2713"))  # a held-back tail

    model._stream = stream
    assert model.execute(requests) is None
    model.wait_idle(timeout=60)
    assert seen == [[0, 0, 0], [4, 0, 0]]  # one request thread: each answered before the next starts
    first = requests[0].sender.sent
    assert [f for _, f in first] == [0, 0, 0, pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL]
    chunks = [r.tensor("text_output")[0] for r, _ in first[:3]]
    assert chunks == [b" one", b" two", " \u2713".encode()]  # joined, the chunks are the whole continuation
    final = first[3][0]
    assert final.tensor("text_output")[0] == "def f(x): one two \u2713".encode() and final.tensor("verified_tokens")
    (only, flags), = requests[1].sender.sent  # not streaming: one final response
    assert flags == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and only.tensor("text_output")[0] == "abc one two \u2713".encode()
    (bad, flags), = requests[2].sender.sent
    assert flags == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and "must be an integer tensor" in bad.error.message()


def test_llm_config_path_selects_the_model_yaml(engine_dir, tmp_path, monkeypatch):
    """As TensorRT-LLM's llmapi model: $LLM_CONFIG_PATH (relative to the version dir) replaces model.yaml."""
    module, repo = _load_model(engine_dir, tmp_path, monkeypatch, "cfgpath", decoupled=False)
    alt = yaml.safe_load((repo / "moespec" / "1" / "model.yaml").read_text())
    alt["triton_config"] = {"max_batch_size": 4, "decoupled": True}
    (repo / "moespec" / "1" / "alt.yaml").write_text(yaml.safe_dump(alt))
    monkeypatch.setenv("LLM_CONFIG_PATH", "alt.yaml")
    cfg = module.TritonPythonModel.auto_complete_config(pb.AutoCompleteConfig())
    assert cfg.policy == {"decoupled": True} and cfg.max_batch_size == 4


def test_one_server_serves_and_forgets_an_mpirun_launch(engine_dir, tmp_path, monkeypatch):
    """F6: like TensorRT-LLM's llmapi stub, the model deletes inherited MPI job variables at import (so TensorRT-LLM
    can spawn its workers); a server started as one of several mpirun ranks is refused with one message."""
    for key, value in (("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_RANK", "1"), ("PMIX_RANK", "1"),
                       ("OMPI_MCA_orte_hnp_uri", "x"), ("OMPI_MCA_btl", "keep")):
        monkeypatch.setenv(key, value)
    module, _ = _load_model(engine_dir, tmp_path, monkeypatch, "ranks", decoupled=False)
    import os

    assert not {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "OMPI_MCA_orte_hnp_uri"} & set(os.environ)
    assert os.environ["OMPI_MCA_btl"] == "keep"  # configuration, not job state
    built = []
    monkeypatch.setattr("trtllm_moespec.runtime.executor.Executor.__init__", lambda self, *a, **k: built.append(k))
    with pytest.raises(ValueError, match="start one `tritonserver"):
        module.TritonPythonModel().initialize({})
    assert built == []
    single, _ = _load_model(engine_dir, tmp_path, monkeypatch, "single", decoupled=False)
    single.TritonPythonModel().initialize({})
    assert len(built) == 1 and "world_size" not in built[0] and "mpi_session" not in built[0]


def test_decoupled_execute_returns_while_requests_run(engine_dir, tmp_path, monkeypatch):
    """F5: in decoupled mode execute() hands requests to request threads and returns, so requests of a later
    execute() join those in flight (the llmapi model's generate_async + response thread)."""
    import threading

    module, _ = _load_model(engine_dir, tmp_path, monkeypatch, "async")
    model = module.TritonPythonModel()
    model.decoupled = True
    model.executor = type("Batched", (), {"batched": True, "max_batch_size": 4, "shutdown": lambda self: None})()
    release, started = threading.Event(), []

    def stream(params):
        started.append(params.prompt)
        assert release.wait(timeout=60)
        yield _Event(output=_output(text=params.prompt.upper()))

    model._stream = stream
    first, second = _request(), _request(text_input=np.array([b"abc"], dtype=np.object_))
    assert model.execute([first]) is None  # returns although the request has not finished
    assert model.execute([second]) is None
    for _ in range(600):
        if len(started) == 2:
            break
        threading.Event().wait(0.05)
    assert sorted(started) == ["abc", "def f(x):"] and not first.sender.sent  # both in flight together
    release.set()
    model.finalize()
    assert first.sender.sent[0][0].tensor("text_output")[0] == b"DEF F(X):"
    assert second.sender.sent[0][1] == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def test_execute_decoupled_sends_final_responses(engine_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    repo = tmp_path / "repo"
    triton_repo_main(["--engine-dir", str(engine_dir), "--out", str(repo), "--decoupled"])
    spec = importlib.util.spec_from_file_location("moespec_triton_model2", repo / "moespec" / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.decoupled = True
    model._stream = lambda params: iter([_Event(output=_output(text=params.prompt.upper()))])
    requests = [_request(), _request(text_input=np.array([b"abc"], dtype=np.object_))]
    assert model.execute(requests) is None
    model.wait_idle(timeout=60)
    (first, flags), = requests[0].sender.sent
    assert flags == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and first.tensor("text_output")[0] == b"DEF F(X):"
    assert requests[1].sender.sent[0][0].tensor("text_output")[0] == b"ABC"


def _engine_ready():
    from tests.runtime.test_executor import _engine_ready as ready

    return ready()


@pytest.mark.skipif(_engine_ready() is not None, reason=str(_engine_ready()))
def test_triton_model_on_the_pytorch_engine(tmp_path, monkeypatch):
    from tests.runtime.test_executor import TINY
    from trtllm_moespec.backends.trtllm import build

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    engine = tmp_path / "engine"
    assert build.main(["--model", str(TINY / "target"), "--draft-model", str(TINY / "eagle3"), "--policy", "eagle3",
                       "--verify-lengths", "8", "--max-draft-tokens", "8", "--out", str(engine), "--dry-run"]) == 0
    repo = tmp_path / "repo"
    assert triton_repo_main(["--engine-dir", str(engine), "--out", str(repo), "--backend", "pytorch", "--dtype", "float32"]) == 0
    spec = importlib.util.spec_from_file_location("moespec_triton_model3", repo / "moespec" / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({"model_repository": str(repo / "moespec"), "model_version": "1"})
    (response,) = model.execute([_request(sampling_param_max_tokens=np.array([8], dtype=np.int32))])
    assert response.error is None, response.error and response.error.message()
    assert len(response.tensor("text_output")[0]) > 0 and response.tensor("mean_accepted_tokens")[0] > 1


@pytest.mark.skipif(_engine_ready() is not None, reason=str(_engine_ready()))
@pytest.mark.parametrize("decoupled", [False, True])
def test_triton_requests_share_the_batched_engine(tmp_path, monkeypatch, decoupled):
    """One execute() with two requests: both run in the engine's batch at once (steps shared),
    each answered with what it gets alone."""
    from tests.runtime.test_executor import TINY
    from trtllm_moespec.backends.trtllm import build

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    engine = tmp_path / "engine"
    assert build.main(["--model", str(TINY / "target"), "--draft-model", str(TINY / "eagle3"), "--policy", "eagle3",
                       "--verify-lengths", "8", "--max-draft-tokens", "8", "--out", str(engine), "--dry-run"]) == 0
    repo = tmp_path / "repo"
    args = ["--engine-dir", str(engine), "--out", str(repo), "--backend", "pytorch", "--dtype", "float32"]
    assert triton_repo_main(args + (["--decoupled"] if decoupled else [])) == 0
    spec = importlib.util.spec_from_file_location(f"moespec_triton_batch_{decoupled}", repo / "moespec" / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({"model_repository": str(repo / "moespec"), "model_version": "1"})
    assert model.executor.batched
    texts = [b"def f(x):", b"The capital of France is"]

    def requests():
        return [_request(text_input=np.array([t], dtype=np.object_),
                         sampling_param_max_tokens=np.array([16], dtype=np.int32)) for t in texts]

    def answers(reqs, responses):
        if not decoupled:
            return [r.tensor("text_output")[0] for r in responses]
        model.wait_idle(timeout=600)
        return [r.sender.sent[-1][0].tensor("text_output")[0] for r in reqs]

    alone = []
    for r in requests():
        alone += answers([r], model.execute([r]))
    metrics = model.executor._impl.scheduler.metrics
    steps_before, size_before = metrics.engine_steps, metrics.batch_size_sum
    both = requests()
    together = answers(both, model.execute(both))
    model.finalize()
    assert together == alone
    assert metrics.batch_size_sum - size_before > metrics.engine_steps - steps_before  # steps carried both
