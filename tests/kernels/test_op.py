"""torch.ops.moespec.select_tree: CPU == reference, fake shapes, opcheck."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from trtllm_moespec.kernels import select_tree, select_tree_reference

from .cases import MODES, assert_same_selection, random_case


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(0, 8), num_nodes=st.integers(0, 16),
       grid=st.booleans())
def test_cpu_op_equals_reference(seed, batch, num_nodes, grid):
    case = random_case(seed, batch, num_nodes, grid=grid)
    for mode in MODES:
        want = select_tree_reference(*case.args(), mode=mode, **case.kwargs())
        got = select_tree(*case.args(), mode=mode, **case.kwargs())
        assert_same_selection(want, got, mode)
        assert got.node_idx.shape == (batch, case.budget)


@pytest.mark.parametrize("mode", MODES)
def test_fake_impl_shapes_and_dtypes(mode):
    case = random_case(3, 5, 9, budget=7)
    with FakeTensorMode() as fake_mode:
        args = [fake_mode.from_tensor(t) for t in case.args()]
        out = torch.ops.moespec.select_tree(*args, mode, case.budget, case.c0, case.c_tok, case.c_exp, case.eps)
    assert [tuple(t.shape) for t in out] == [(5, 7), (5,), (5,), (5,)]
    assert [t.dtype for t in out] == [torch.int64, torch.int64, torch.float64, torch.float64]


@pytest.mark.parametrize("mode", ["evict", "joint"])
def test_opcheck(mode):
    case = random_case(11, 3, 8, budget=5)
    args = (*case.args(), mode, case.budget, case.c0, case.c_tok, case.c_exp, case.eps)
    torch.library.opcheck(torch.ops.moespec.select_tree.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_fake_impl_rejects_bad_shapes():
    case = random_case(3, 2, 4)
    with FakeTensorMode() as fake_mode:
        args = [fake_mode.from_tensor(t) for t in case.args()]
        args[4] = fake_mode.from_tensor(torch.zeros(2, 3, 1, dtype=torch.int64))
        with pytest.raises(ValueError, match="node_bits"):
            torch.ops.moespec.select_tree(*args, "ecospec", 3, 1.0, 0.0, 0.0, 1e-3)
