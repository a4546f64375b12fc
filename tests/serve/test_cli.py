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
