"""Cost tables, the expert-aware fit and the roofline estimate."""

import json

import numpy as np
import pytest

from trtllm_moespec.core import ARCHITECTURES, CostTable, ExpertCostModel, RooflineCostModel, architecture


def test_cost_table_round_trip_and_compatibility(tmp_path):
    table = CostTable((0.010, 0.012, 0.015), model_id="m", device="cpu", dtype="float32", tree=(2, 1, 2),
                      method="test", expert_model=ExpertCostModel(0.01, 0.001, 0.0002, 1e-4, 10))
    path = table.save(tmp_path / "cost_profile.json")
    loaded = CostTable.load(path, model_id="m", device="cpu", dtype="float32", tree=(2, 1, 2))
    assert loaded == table
    with pytest.raises(ValueError, match="model 'm'"):
        CostTable.load(path, model_id="other")
    with pytest.raises(ValueError, match="device"):
        CostTable.load(path, device="H200")
    with pytest.raises(ValueError, match="tree"):
        CostTable.load(path, tree=(4, 8, 32))
    assert CostTable.load(path, model_id="other", override=True).costs == table.costs


@pytest.mark.parametrize("costs,match", [((), "empty"), ((0.1, float("nan")), "finite"), ((0.1, -0.2), "positive"),
                                         ((0.0,), "positive"), ((0.1, float("inf")), "finite")])
def test_bad_cost_tables(costs, match):
    with pytest.raises(ValueError, match=match):
        CostTable(costs)


def test_bad_cost_profile_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        CostTable.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        CostTable.load(tmp_path / "bad.json")
    (tmp_path / "v.json").write_text(json.dumps({"costs": [1.0], "version": 99}))
    with pytest.raises(ValueError, match="version"):
        CostTable.load(tmp_path / "v.json")


def test_expert_cost_fit_recovers_coefficients():
    rng = np.random.default_rng(0)
    k = rng.integers(0, 33, 200)
    u = 20 + 3 * k + rng.integers(0, 10, 200)
    lat = 0.005 + 0.0002 * k + 0.0004 * u + rng.normal(0, 1e-5, 200)
    m = ExpertCostModel.fit(k, u, lat)
    assert abs(m.c0 - 0.005) < 2e-4 and abs(m.c_tok - 0.0002) < 5e-5 and abs(m.c_exp - 0.0004) < 2e-5
    assert m.residual_rms < 3e-5 and m.num_samples == 200
    # A slope that comes out negative (noise) is dropped, never kept.
    m2 = ExpertCostModel.fit(k, u, 0.01 - 1e-6 * k + 0.0004 * u)
    assert m2.c_tok >= 0 and m2.c_exp > 0
    with pytest.raises(ValueError):
        ExpertCostModel.fit([1, 2], [1, 2], [1, 2])


def test_roofline_is_monotone_and_labelled():
    for name in ARCHITECTURES:
        model = RooflineCostModel.for_device(architecture(name), "H200")
        table = model.cost_table(32)
        assert all(b >= a for a, b in zip(table.costs, table.costs[1:]))
        assert "not measured" in table.method
        assert model.expert_model().c_exp > 0
    with pytest.raises(ValueError, match="device"):
        RooflineCostModel.for_device(architecture("gpt-oss-20b"), "TPU")
    with pytest.raises(ValueError, match="preset"):
        architecture("llama-moe")
