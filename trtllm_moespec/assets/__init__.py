"""Artefacts shipped inside the package: the trained `moespec-tiny` model family."""

from __future__ import annotations

from pathlib import Path

TINY_DIR = Path(__file__).resolve().parent / "moespec-tiny"


def tiny_model_paths() -> dict[str, Path]:
    """Paths of the embedded default: keys `target`, `draft`, `predictor` (EcoSpec's standalone
    predictor), `predictor_head` (ours: a head on the drafter's hidden state), `calibrator` (the node-value
    calibrator prior) and `acceptance_head` (the learned acceptance head).

    Raises FileNotFoundError when the package was installed without its assets.
    """
    paths = {"target": TINY_DIR / "target", "draft": TINY_DIR / "eagle3", "predictor": TINY_DIR / "predictor",
             "predictor_head": TINY_DIR / "predictor-head", "calibrator": TINY_DIR / "values" / "calibrator.json",
             "acceptance_head": TINY_DIR / "acceptance-head"}
    if not (paths["target"] / "config.json").is_file():
        raise FileNotFoundError(f"the embedded moespec-tiny target is missing at {paths['target']}; reinstall the "
                                "package or rebuild it with `python build_scripts/train_tiny.py`")
    return paths
