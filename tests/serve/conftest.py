"""The embedded moespec-tiny model with an EAGLE-3 drafter, loaded once for the serving tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llm():
    from trtllm_moespec import LLM

    return LLM(model="moespec-tiny", policy="eagle3")
