"""Triton kernels == reference, in Triton's interpreter on CPU tensors.

Not collected by the normal test run (the file name does not start with test_):
test_triton_select.py runs it in a subprocess with TRITON_INTERPRET=1, because
Triton reads that variable when it is imported and the flag must not leak into
other tests.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_moespec.kernels import parse_mode, select_tree_reference
from trtllm_moespec.kernels.triton_select import select_tree_triton
from trtllm_moespec.core.policies import Selection

from tests.kernels.cases import MODES, assert_same_selection, random_case

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_triton_select.py (needs TRITON_INTERPRET=1)"


def _triton(case, mode, word_chunk=2, node_chunk=4):
    # Small chunks: the word and node loops (and a partial last chunk) run even for W = 2..3 and N = 5..10.
    return Selection(*select_tree_triton(*case.args(), mode=parse_mode(mode), word_chunk=word_chunk,
                                         node_chunk=node_chunk, **case.kwargs()))


@settings(max_examples=int(os.environ.get("MOESPEC_INTERP_EXAMPLES", "10")), deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(0, 8), num_nodes=st.integers(0, 10),
       layers=st.integers(1, 10), grid=st.booleans())
def test_triton_equals_reference(seed, batch, num_nodes, layers, grid):
    case = random_case(seed, batch, num_nodes, layers=layers, experts=16, grid=grid)
    for mode in MODES:
        want = select_tree_reference(*case.args(), mode=mode, **case.kwargs())
        assert_same_selection(want, _triton(case, mode), mode)


def test_triton_k1_empty_frontier_all_padded():
    one = random_case(5, 3, 1, budget=1, max_k=1)  # K = 1, one node
    padded = random_case(6, 2, 6)
    padded = type(padded)(**{**padded.__dict__, "valid": torch.zeros_like(padded.valid)})  # empty frontier
    for case in (one, padded):
        for mode in MODES:
            want = select_tree_reference(*case.args(), mode=mode, **case.kwargs())
            assert_same_selection(want, _triton(case, mode), mode)


@pytest.mark.parametrize("mode", MODES)
def test_triton_94_layers_256_experts(mode):
    case = random_case(7, 2, 20, layers=94, experts=256, topk=8, budget=12)
    assert case.node_bits.shape[2] == 376
    want = select_tree_reference(*case.args(), mode=mode, **case.kwargs())
    assert_same_selection(want, _triton(case, mode, word_chunk=128), mode)  # 3 chunks, the last one partial
