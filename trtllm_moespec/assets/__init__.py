"""Artefacts shipped inside the package: the trained model families `moespec-tiny` (the fast model of
the test suite) and `moespec-base` (the deployment cost regime, the default where a model is optional)."""

from __future__ import annotations

import os
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
SHIPPED_MODELS = ("moespec-base", "moespec-tiny")
# Where no model is named (CLI --model, LLM(model=...)). MOESPEC_DEFAULT_MODEL overrides it: the test
# suite sets moespec-tiny, the fast model, so only the tests that name moespec-base pay for it.
DEFAULT_MODEL = os.environ.get("MOESPEC_DEFAULT_MODEL") or "moespec-base"
TINY_DIR = ASSETS_DIR / "moespec-tiny"


def shipped_model_paths(name: str) -> dict[str, Path]:
    """Paths of a shipped family: keys `target`, `draft`, `predictor` (EcoSpec's standalone predictor, or
    the draft head where the family ships none), `predictor_head` (ours: a head on the drafter's hidden state), `calibrator` (the
    node-value calibrator prior), `acceptance_head` (the learned acceptance head) and `policy_defaults` (the
    policy options tuned for the family, `policy_defaults.py`).

    Raises FileNotFoundError when the package was installed without the family's assets.
    """
    if name not in SHIPPED_MODELS:
        raise ValueError(f"{name!r} is not a shipped model; shipped: {', '.join(SHIPPED_MODELS)}")
    root = ASSETS_DIR / name
    paths = {"target": root / "target", "draft": root / "eagle3", "predictor": root / "predictor",
             "predictor_head": root / "predictor-head", "calibrator": root / "values" / "calibrator.json",
             "acceptance_head": root / "acceptance-head", "policy_defaults": root / "policy_defaults.json"}
    if not paths["predictor"].is_dir():  # moespec-base ships only our draft-head predictor: ecospec uses it too
        paths["predictor"] = paths["predictor_head"]
    if not (paths["target"] / "config.json").is_file():
        raise FileNotFoundError(f"the embedded {name} target is missing at {paths['target']}; reinstall the "
                                f"package or rebuild it with `python build_scripts/train_model.py --family {name.split('-')[1]}`")
    return paths


def tiny_model_paths() -> dict[str, Path]:
    """`shipped_model_paths("moespec-tiny")`: the model the tests use where speed matters."""
    return shipped_model_paths("moespec-tiny")
