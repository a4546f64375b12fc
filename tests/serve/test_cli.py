"""`moespec serve` argument errors are one-line errors with exit code 2 (before any model loads)."""

from __future__ import annotations

import pytest

from trtllm_moespec.cli import main


@pytest.mark.parametrize("argv, message", [
    (["serve", "--max-batch-size", "0"], "--max-batch-size"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--policy", "joint-batch", "--engine", "round-robin"], "joint-batch"),
    (["serve", "--chat-template", "/nonexistent/template.jinja"], "template.jinja"),
])
def test_bad_serve_arguments_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("moespec: error:") and message in err and len(err.strip().splitlines()) == 1


def test_batch_policies_are_declared_for_serve_only():
    from trtllm_moespec.cli import BATCH_POLICY_CHOICES
    from trtllm_moespec.engine.batch import BATCH_POLICIES
    from trtllm_moespec.serve.server import build_parser

    assert set(BATCH_POLICY_CHOICES) == set(BATCH_POLICIES)  # the CLI stays torch-free, so it lists them again

    policy = next(a for a in build_parser()._actions if a.dest == "policy")
    assert set(BATCH_POLICY_CHOICES) <= set(policy.choices) and "joint-batch" in policy.metavar
    assert build_parser().parse_args(["--policy", "joint-batch"]).policy == "joint-batch"


def test_generate_rejects_a_batch_policy(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--policy", "joint-batch", "--prompt", "hi"])
    assert e.value.code == 2 and "joint-batch" in capsys.readouterr().err
