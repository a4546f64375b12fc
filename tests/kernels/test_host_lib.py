"""The CUDA C++ logic (plugins/tree_select/tree_select.h), built for the host with g++,
equals the reference through ctypes, also with several simulated lanes per request."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_moespec.kernels import select_tree_reference
from trtllm_moespec.kernels.host_lib import HostTreeSelect, build_host_library

from .cases import MODES, assert_same_selection, random_case

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH: cannot build the host library")


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    return HostTreeSelect(build_host_library(tmp_path_factory.mktemp("host_lib")))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(0, 8), num_nodes=st.integers(0, 20),
       layers=st.integers(1, 12), grid=st.booleans(), lanes=st.sampled_from([1, 3, 32]))
def test_host_equals_reference(host, seed, batch, num_nodes, layers, grid, lanes):
    case = random_case(seed, batch, num_nodes, layers=layers, experts=16, grid=grid)
    for mode in MODES:
        want = select_tree_reference(*case.args(), mode=mode, **case.kwargs())
        got = host.select(*case.args(), mode=mode, num_lanes=lanes, **case.kwargs())
        assert_same_selection(want, got, f"{mode} lanes={lanes}")


@pytest.mark.parametrize("lanes", [1, 128])
def test_host_equals_reference_94_layers_256_experts(host, lanes):
    case = random_case(7, 2, 24, layers=94, experts=256, topk=8, budget=16)
    assert case.node_bits.shape[2] == 376
    for mode in MODES:
        want = select_tree_reference(*case.args(), mode=mode, **case.kwargs())
        assert_same_selection(want, host.select(*case.args(), mode=mode, num_lanes=lanes, **case.kwargs()), mode)


def test_host_single_node_and_all_padded(host):
    one = random_case(5, 3, 1, budget=1, max_k=1)
    padded = random_case(6, 2, 6)
    padded = type(padded)(**{**padded.__dict__, "valid": torch.zeros_like(padded.valid)})
    for case in (one, padded):
        for mode in MODES:
            want = select_tree_reference(*case.args(), mode=mode, **case.kwargs())
            assert_same_selection(want, host.select(*case.args(), mode=mode, **case.kwargs()), mode)
    assert (host.select(*padded.args(), mode="joint", **padded.kwargs()).num_selected == 0).all()


def test_host_status_errors(host):
    case = random_case(1, 1, 4)
    with pytest.raises(ValueError, match="eps"):  # caught by the shared Python checks first
        host.select(*case.args(), mode="ecospec", budget=2, eps=0.0)
    fn = host._fn
    assert fn(1, 4, 1, None, None, None, None, None, None, None, 1, 9, 2, 1.0, 0.0, 0.0, 1e-3, 1,
              None, None, None, None) == 1  # bad mode
    assert fn(1, 4, 1, None, None, None, None, None, None, None, 0, 0, 2, 1.0, 0.0, 0.0, 1e-3, 1,
              None, None, None, None) == 4  # evict without a cost table
    assert fn(1, 4, 1, None, None, None, None, None, None, None, 1, 3, 2, 0.1, -1.0, 0.0, 1e-3, 1,
              None, None, None, None) == 3  # joint cost model that can go non-positive


def test_host_survives_nan_scores_and_corrupt_parents(host):
    """The native plugin validates nothing, so garbage in must not crash it. NaN scores rank last (before,
    they made ranks collide, leaving workspace slots unwritten: indices read from uninitialised memory);
    a parent list with a cycle or an index past the tree ends the ancestor walk (ecospec_global) instead
    of hanging or reading past the buffers. What is selected from such input is unspecified (the
    reference's NaN arithmetic differs); that it is a set of distinct in-range nodes is checked."""
    case = random_case(11, 2, 12, budget=8)
    N, budget = case.scores.shape[1], case.kwargs()["budget"]
    scores = case.scores.clone()
    scores[0, [1, 4, 7]] = float("nan")
    parents = case.parents.clone()
    parents[0, 3], parents[0, 5] = 5, 3  # a cycle
    parents[1, 2] = 1000  # past the tree
    for bad, mode in ((type(case)(**{**case.__dict__, "scores": scores}), "evict"),
                      (type(case)(**{**case.__dict__, "parents": parents}), "ecospec_global")):
        for lanes in (1, 3):
            got = host.select(*bad.args(), mode=mode, num_lanes=lanes, **bad.kwargs())
            assert got.node_idx.shape == (2, budget)
            for row, n in zip(got.node_idx.tolist(), got.num_selected.tolist()):
                picked = row[:n]
                assert 0 <= n <= budget and all(0 <= v < N for v in picked) and len(set(picked)) == n
                assert all(v == -1 for v in row[n:])
