"""Resolve what a user names (a model dir or `moespec-tiny`, profiles, predictors) into
checked local paths and loaded artefacts, failing early with a message that says
how to fix the problem. Nothing is ever downloaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .core.cost import CostTable, RooflineCostModel
from .core.presets import MoEArchitecture
from .engine.config import TreeConfig

log = logging.getLogger(__name__)
TINY = "moespec-tiny"
PROFILE_NAME = "cost_profile.json"
CALIBRATOR_NAME = "value_calibrator.json"


@dataclass(frozen=True)
class ModelPaths:
    target: Path  # Hugging Face checkpoint directory
    draft: Path | None  # EAGLE-3 drafter directory
    predictor: Path | None  # expert predictor directory (EcoSpec's standalone predictor by default)
    model_id: str  # what cost profiles are keyed by
    cost_profile: Path  # where the model's own profile lives (may not exist yet)
    predictor_head: Path | None = None  # our draft-head predictor shipped with the model, if any
    calibrator: Path | None = None  # value calibrator prior (core/values.py) shipped with the model, if any
    acceptance_head: Path | None = None  # learned acceptance head shipped with the model, if any


def resolve_model(model: str, draft_model: str | None = None, predictor: str | None = None) -> ModelPaths:
    if model == TINY:
        from .assets import tiny_model_paths

        p = tiny_model_paths()
        target, draft, pred, model_id = p["target"], p["draft"], p["predictor"], TINY
        profile = p["target"].parent / PROFILE_NAME
        head = p["predictor_head"] if p["predictor_head"].is_dir() else None
        values_dir = {"calibrator": p["calibrator"] if p["calibrator"].is_file() else None,
                      "acceptance_head": p["acceptance_head"] if p["acceptance_head"].is_dir() else None}
    else:
        target = Path(model).expanduser()
        if not target.is_dir():
            raise FileNotFoundError(f"model directory not found: {model} (models are loaded from local directories "
                                    f"only; use '{TINY}' for the embedded default)")
        draft, pred, model_id, profile, head = None, None, target.resolve().name, target / PROFILE_NAME, None
        calib = target / CALIBRATOR_NAME
        values_dir = {"calibrator": calib if calib.is_file() else None, "acceptance_head": None}
    if draft_model is not None:
        draft = _existing_dir(draft_model, "draft model")
    if predictor is not None and predictor != "oracle":
        pred = head = _existing_dir(predictor, "expert predictor")
    return ModelPaths(target, draft if draft is None or draft.is_dir() else None,
                      pred if pred is None or pred.is_dir() else None, model_id, profile, head, **values_dir)


def _existing_dir(path: str | Path, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"{what} directory not found: {path}")
    return p


def device_name(device: torch.device | str) -> str:
    """The device string cost profiles are keyed by: 'cpu' or 'cuda:<GPU name>'."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def load_cost_profile(policy: str, cost_profile, paths: ModelPaths, device: str, dtype: str, tree: TreeConfig,
                      override: bool) -> CostTable | None:
    """The profile a policy needs (evict, joint; optional for oracle), checked against this setting."""
    needs = policy in ("evict", "joint")
    if cost_profile is None and not needs:
        return None
    if isinstance(cost_profile, CostTable):
        cost_profile.check_compatible(paths.model_id, device, dtype, tree.as_tuple(), override)
        return cost_profile
    if isinstance(cost_profile, str) and cost_profile.startswith("roofline"):
        return _roofline_profile(cost_profile, paths, tree)
    path = Path(cost_profile) if cost_profile is not None else paths.cost_profile
    if not path.is_file():
        raise ValueError(
            f"policy {policy!r} needs a cost profile and there is none at {path}. Make one on this machine with "
            f"`moespec profile --model {paths.model_id if paths.model_id == TINY else paths.target}`, pass "
            "cost_profile=PATH, or cost_profile='roofline:H200' for a labelled (unmeasured) estimate")
    return CostTable.load(path, model_id=paths.model_id, device=device, dtype=dtype, tree=tree.as_tuple(),
                          override=override)


def _roofline_profile(spec: str, paths: ModelPaths, tree: TreeConfig) -> CostTable:
    from .models.checkpoint import read_config_json

    _, _, device = spec.partition(":")
    cfg = read_config_json(paths.target, "target checkpoint")
    arch = MoEArchitecture(
        name=paths.model_id, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        num_heads=cfg["num_attention_heads"], num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        num_experts=cfg.get("num_experts") or cfg.get("num_local_experts"), top_k=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"], vocab_size=cfg["vocab_size"])
    model = RooflineCostModel.for_device(arch, device or "H200")
    table = model.cost_table(tree.max_draft_tokens, model_id=paths.model_id)
    log.warning("using a roofline ESTIMATE of C(k) for %s on %s (not measured): %s", paths.model_id, device, table.method)
    return CostTable(table.costs, table.model_id, table.device, table.dtype, tree.as_tuple(), table.method,
                     expert_model=model.expert_model())


def load_predictor(predictor, paths: ModelPaths, target):
    """The expert predictor adapter the engine calls each step."""
    from .engine.predictors import LearnedExperts, OracleExperts

    if predictor == "oracle":
        return OracleExperts(target)
    if paths.predictor is None:
        raise ValueError("no expert predictor: pass predictor=DIR or predictor='oracle'")
    from .models.predictor_head import is_head_predictor_dir

    if is_head_predictor_dir(paths.predictor):  # ours: a head on the EAGLE-3 drafter's hidden
        from .engine.predictors import HeadExperts
        from .models.predictor_head import DraftHeadPredictor

        head = DraftHeadPredictor.load(paths.predictor)
        head.check_target(len(target.moe_layers), target.num_experts, target.experts_per_token, target.vocab_size,
                          target.hidden_size)
        return HeadExperts(head.to(target.device), target.input_embeddings(), target.num_experts)
    from .models.predictor import ExpertPredictor

    model = ExpertPredictor.load(paths.predictor)
    model.check_target(len(target.moe_layers), target.num_experts, target.experts_per_token, target.vocab_size)
    return LearnedExperts(model.to(target.device) if hasattr(model, "to") else model, target.num_experts)


def load_value_model(kind: str, paths: ModelPaths, target=None):
    """The node-value model of the cost-aware policies: 'raw' (draft path scores, the ablation),
    'calibrated' (per-depth isotonic calibration of q; the model's shipped prior, else an identity
    prior learnt online) or 'head' (the learned acceptance head shipped with the model)."""
    from .core.values import VALUE_KINDS, CalibratedValues, Calibrator, RawValues

    if kind not in VALUE_KINDS:
        raise ValueError(f"unknown values {kind!r}; choose one of {', '.join(VALUE_KINDS)}")
    if kind == "raw":
        return RawValues()
    if kind == "calibrated":
        prior = Calibrator.load(paths.calibrator) if paths.calibrator is not None else Calibrator()
        return CalibratedValues(prior)
    if paths.acceptance_head is None:
        raise ValueError(f"values='head' needs a learned acceptance head; {paths.model_id} ships none (use "
                         "values='calibrated')")
    from .models.acceptance_head import load_head_values

    return load_head_values(paths.acceptance_head, target)
