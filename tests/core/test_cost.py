"""Cost tables, the expert-aware fit and the roofline estimate."""

import json

import numpy as np
import pytest

from trtllm_moespec.core import ARCHITECTURES, CostTable, ExpertCostModel, RooflineCostModel, architecture
from trtllm_moespec.core.cost import expert_term_pays


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


def _curve_samples(slope_within: float, offsets=(-10.0, 0.0, 10.0)):
    """Steps at k = 0..8 whose cost is a concave k-curve plus `slope_within` per woken pair at fixed k;
    U grows with k, concave as measured U does, and varies by `offsets` at each k >= 1."""
    k, U, t = [], [], []
    for kk in range(9):
        for e in (offsets if kk else (0.0,)):
            u = 96 + 60 * np.sqrt(kk) + e
            k.append(kk), U.append(u), t.append(0.020 + 0.004 * np.sqrt(kk) + slope_within * e)
    return np.array(k), np.array(U), np.array(t)


def test_within_k_fit_recovers_the_slope_the_k_curve_hides():
    """The global fit's c_exp absorbs the k-curve (U rises with k); the within-k slope is what choosing
    nodes by their experts can change, and the spread is how far U moves at fixed k."""
    k, U, t = _curve_samples(5e-6)
    m = ExpertCostModel.fit(k, U, t)
    assert m.c_exp_within == pytest.approx(5e-6, rel=1e-9)
    assert m.unique_spread == pytest.approx(np.sqrt(200 / 3), rel=1e-9)  # offsets -10, 0, 10 at every k >= 1
    assert m.expert_saving == pytest.approx(5e-6 * np.sqrt(200 / 3), rel=1e-9)
    assert m.c_exp > 5 * m.c_exp_within  # the global slope is mostly the k-curve
    flat = ExpertCostModel.fit(*_curve_samples(5e-6, offsets=(0.0,)))  # no spread at fixed k: nothing to say
    assert flat.c_exp_within is None and flat.unique_spread is None and flat.expert_saving is None
    assert ExpertCostModel.fit(*_curve_samples(-5e-6)).c_exp_within == 0.0  # cheaper with more experts: noise


def test_expert_term_pays_against_its_measured_overhead(tmp_path):
    model = ExpertCostModel(0.03, 7e-4, 2e-5, c_exp_within=5e-6, unique_spread=40.0)  # saves ~0.2 ms
    dear = CostTable((0.024, 0.031), expert_model=model, expert_overhead=3e-3)
    cheap = CostTable((0.024, 0.031), expert_model=model, expert_overhead=1e-4)
    pays, why = expert_term_pays(dear)
    assert not pays and "does not pay" in why and "0.20 ms" in why and "3.00 ms" in why
    assert expert_term_pays(cheap)[0]
    # profiles made before these fields keep the term, and say why
    old = CostTable((0.024, 0.031), expert_model=ExpertCostModel(0.03, 7e-4, 2e-5))
    assert expert_term_pays(old) == (True, pytest.approx(expert_term_pays(old)[1]))
    assert "re-run `moespec profile`" in expert_term_pays(old)[1]
    path = dear.save(tmp_path / "p.json")
    assert CostTable.load(path) == dear


@pytest.mark.parametrize("field,value,match", [
    ("expert_overhead", -1e-3, "expert_overhead"), ("expert_overhead", "1 ms", "expert_overhead"),
])
def test_bad_expert_overhead_is_named(tmp_path, field, value, match):
    data = CostTable((0.024, 0.031)).to_json()
    data[field] = value
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        CostTable.load(tmp_path / "p.json")


@pytest.mark.parametrize("key,value", [("c_exp_within", -1e-6), ("unique_spread", "wide"), ("c_exp_within", float("nan"))])
def test_bad_within_k_fields_are_named(tmp_path, key, value):
    data = CostTable((0.024, 0.031), expert_model=ExpertCostModel(0.03, 7e-4, 2e-5)).to_json()
    data["expert_model"][key] = value
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=key):
        CostTable.load(tmp_path / "p.json")
