"""Resolve what a user names (a model dir or `moespec-tiny`, profiles, predictors) into
checked local paths and loaded artefacts, failing early with a message that says
how to fix the problem. Nothing is ever downloaded.

`resolve_config` is the one resolution step of `LLM`: the user's `MoESpecConfig` and
`RuntimeConfig` become a `ResolvedConfig` (config.py) with every default decided and every
named file checked, cheap checks first and the model before anything derived from it, so a
bad checkpoint, a missing profile or drafter, or a tree the drafter cannot draft fails before
any weights load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .assets import SHIPPED_MODELS, shipped_model_paths
from .config import COST_AWARE, TINY, MoESpecConfig, ResolvedConfig, RuntimeConfig
from .core.cost import CostTable, RooflineCostModel
from .core.policies import POLICIES
from .core.presets import MoEArchitecture
from .engine.config import TreeConfig
from .policy_defaults import FILE_NAME as POLICY_DEFAULTS_NAME
from .policy_defaults import PolicyDefaults, load_for, merged_options

log = logging.getLogger(__name__)
__all__ = ["TINY", "ModelPaths", "resolve_config", "resolve_model"]
PROFILE_NAME = "cost_profile.json"
CALIBRATOR_NAME = "value_calibrator.json"  # beside a local model's config.json: its value calibrator prior
ACCEPTANCE_HEAD_NAME = "acceptance_head"  # beside a local model's config.json: its learned acceptance head


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
    policy_defaults: Path | None = None  # the model's tuned policy options (policy_defaults.py), if any


def resolve_config(spec: MoESpecConfig, runtime: RuntimeConfig, ep=None) -> ResolvedConfig:
    """The one resolution step of `LLM` (module docstring): checks in order of cost, defaults decided.
    `ep`: the expert-parallel context of an `mpirun` job, or None (one process)."""
    from .models.checkpoint import parse_dtype

    device = parse_device(runtime.device)
    parse_dtype(runtime.dtype)
    check_threads(runtime.threads)
    if runtime.prefix_cache and (runtime.model_impl != "lean" or ep is not None):
        raise ValueError("prefix_cache needs model_impl='lean' and one process (its K/V copy runs on this "
                         "process's cache only)")
    cuda_graphs = _resolve_cuda_graphs(runtime.cuda_graphs, device, runtime.model_impl, ep)
    policy = spec.policy
    paths = resolve_model(str(runtime.model), spec.draft_model, spec.predictor)
    check_target_dir(paths.target)
    tree = spec.tree if spec.tree is not None else default_tree(spec.cost_profile, paths)
    defaults = load_for(paths.policy_defaults, paths.model_id)  # tuned options, chosen values, the guard's prior
    if spec.values is None:
        spec = replace(spec, values=_default_values(defaults, paths, spec, tree, device_name(device)))
    if spec.values == "head" and paths.acceptance_head is None:
        raise ValueError(f"values='head' needs a learned acceptance head; {paths.model_id} ships none "
                         "(use values='calibrated')")
    if policy == "joint" and spec.drafter == "eagle3" and paths.predictor_head is not None:
        # Ours reads routing off the drafter's hidden state: no extra forward per step.
        paths = replace(paths, predictor=paths.predictor_head)
    needs = POLICIES.get(policy, POLICIES["eagle3"])
    if needs.drafts and spec.drafter == "eagle3" and paths.draft is not None:
        check_tree_fits_drafter(tree, paths.draft)
    if needs.drafts and spec.drafter == "eagle3" and paths.draft is None:
        raise ValueError(f"policy {policy!r} drafts with EAGLE-3 but no draft model was given: pass "
                         "draft_model=DIR (SpecForge format) or drafter='ngram'")
    if needs.needs_experts and paths.predictor is None and spec.predictor != "oracle":
        raise ValueError(f"policy {policy!r} needs an expert predictor: pass predictor=DIR, or predictor='oracle' "
                         "(analysis only: a target forward per step)")
    profile = load_cost_profile(policy, spec.cost_profile, paths, device_name(device), runtime.dtype, tree,
                                spec.override_profile)
    rules_profile = profile if profile is not None else _optional_profile(policy, paths, device, runtime.dtype, tree,
                                                                          spec.override_profile)
    return ResolvedConfig(
        spec=spec, runtime=runtime, paths=paths, device=device, cuda_graphs=cuda_graphs,
        drafter=spec.drafter if needs.drafts else None, profile=profile, rules_profile=rules_profile,
        guard=_resolve_guard(policy, spec.guard, rules_profile),
        draft_stop=_resolve_draft_stop(policy, spec.draft_stop, rules_profile),
        ddd_threshold=spec.ddd_threshold if spec.ddd_threshold is not None else (0.3 if policy == "ddd" else None),
        oracle_predictor=spec.predictor == "oracle", tree=tree,
        policy_options=merged_options(defaults, policy, spec.policy_options or {}, tree.as_tuple(),
                                      device_name(device)),
        guard_prior=_guard_prior(defaults, spec, tree, device_name(device)))


def _own_drafter(spec: MoESpecConfig) -> bool:
    """Drafting with the model's own EAGLE-3 drafter: the one its acceptance head and guard prior were made with."""
    return spec.drafter == "eagle3" and spec.draft_model is None


def _default_values(defaults: PolicyDefaults | None, paths: "ModelPaths", spec: MoESpecConfig, tree: TreeConfig,
                    device: str) -> str:
    """`values=None`: the value model the model chose for this tree and device (its policy_defaults.json,
    from side-by-side runs), where it can run here (the acceptance head reads the hidden state of the
    model's own EAGLE-3 drafter, which it was trained on); else 'calibrated'."""
    chosen = defaults.values_for(tree.as_tuple(), device) if defaults is not None else None
    if chosen == "head" and (paths.acceptance_head is None or not _own_drafter(spec)):
        return "calibrated"
    return chosen or "calibrated"


def _guard_prior(defaults: PolicyDefaults | None, spec: MoESpecConfig, tree: TreeConfig, device: str):
    """The model's measured guard prior for sampled requests (engine/guard.py `SampledPrior`) for this tree and
    device, with the model's own EAGLE-3 drafter, which measured it (None elsewhere)."""
    if defaults is None or not _own_drafter(spec):
        return None
    return defaults.guard_prior_for(tree.as_tuple(), device)


def _resolve_cuda_graphs(requested: bool | None, device: torch.device, model_impl: str, ep) -> bool:
    """Whether the verify forward replays CUDA graphs: on by default for CUDA + lean (the graphs
    capture the lean static-shape forward), never elsewhere; asking for them where they cannot run
    is an error rather than a silent eager run."""
    possible = device.type == "cuda" and model_impl == "lean" and ep is None
    if requested and not possible:
        why = ("the target is on " + str(device)) if device.type != "cuda" else (
            "model_impl='hf' runs transformers' forward" if model_impl != "lean" else "expert parallelism is on")
        raise ValueError(f"cuda_graphs=True needs a CUDA device, model_impl='lean' and no --ep; {why}")
    return possible if requested is None else requested


def _optional_profile(policy: str, paths: "ModelPaths", device: torch.device, dtype: str, tree: TreeConfig,
                      override: bool) -> CostTable | None:
    """The model's own profile for the drafting rules of a cost-aware policy that does not need one
    (ecospec, coverage, ddd): used when present and valid for this setting, else those rules fall back
    (the guard then measures both step kinds itself; drafting is not cut)."""
    if policy not in COST_AWARE or not paths.cost_profile.is_file():
        return None
    try:
        return CostTable.load(paths.cost_profile, model_id=paths.model_id, device=device_name(device), dtype=dtype,
                              tree=tree.as_tuple(), override=override)
    except ValueError:
        return None


def _resolve_guard(policy: str, mode: str, profile: CostTable | None) -> str:
    """The speculate-or-not rule: `auto` = the measured goodput guard for cost-aware policies, off otherwise;
    `measured`; `profiled` (k = 0 before drafting on the profiled costs only); `off`."""
    if mode == "auto":
        mode = "measured" if policy in COST_AWARE else "off"
    if mode == "off" or policy == "ar":
        return "off"
    if mode == "profiled" and (profile is None or profile.plain_step is None):
        raise ValueError("guard='profiled' needs a cost profile with a plain-step cost; re-profile with `moespec profile`")
    return mode


def _resolve_draft_stop(policy: str, requested: bool | None, profile: CostTable | None) -> bool:
    """Stop drafting when more drafter forwards cannot pay (core.drafting): off unless requested.
    It ranks on node values, and a tree it keeps shallow is never verified deep, so the deep values
    are never corrected: on moespec-base at T=0 it held evict at ~2 tokens per step on text that
    fills 4-node chains (-16% tokens/s, `python -m benchmarks.guard_trace`), while a drafter forward there
    costs 1/14 of a plain step, which is all it could save."""
    if not requested:
        return False
    if policy not in COST_AWARE or policy == "ddd":
        raise ValueError(f"draft_stop=True is for the cost-aware policies (not ddd), got policy {policy!r}")
    if profile is None or profile.draft_forward is None:
        raise ValueError("draft_stop=True needs a cost profile with the cost of one drafter forward; "
                         "re-profile with `moespec profile`")
    return True


def resolve_model(model: str, draft_model: str | None = None, predictor: str | None = None) -> ModelPaths:
    if model in SHIPPED_MODELS:
        p = shipped_model_paths(model)
        target, draft, pred, model_id = p["target"], p["draft"], p["predictor"], model
        profile = p["target"].parent / PROFILE_NAME
        head = p["predictor_head"] if p["predictor_head"].is_dir() else None
        values_dir = {"calibrator": p["calibrator"] if p["calibrator"].is_file() else None,
                      "acceptance_head": p["acceptance_head"] if p["acceptance_head"].is_dir() else None,
                      "policy_defaults": p["policy_defaults"] if p["policy_defaults"].is_file() else None}
    else:
        target = Path(model).expanduser()
        if not target.is_dir():
            raise FileNotFoundError(f"model directory not found: {model} (models are loaded from local directories "
                                    f"only; use one of {', '.join(map(repr, SHIPPED_MODELS))} for an embedded model)")
        draft, pred, model_id, profile, head = None, None, target.resolve().name, target / PROFILE_NAME, None
        calib, head_dir, tuned = target / CALIBRATOR_NAME, target / ACCEPTANCE_HEAD_NAME, target / POLICY_DEFAULTS_NAME
        values_dir = {"calibrator": calib if calib.is_file() else None,
                      "acceptance_head": head_dir if head_dir.is_dir() else None,
                      "policy_defaults": tuned if tuned.is_file() else None}
    if draft_model is not None:
        given = _existing_dir(draft_model, "draft model")
        if draft is None or given.resolve() != draft.resolve():
            # The shipped head reads the shipped drafter's hidden state; another drafter's hidden means
            # nothing to it (even at the same width), so policies fall back to the standalone predictor.
            head = None
        draft = given
    if predictor is not None and predictor != "oracle":
        pred = head = _existing_dir(predictor, "expert predictor")
    return ModelPaths(target, draft if draft is None or draft.is_dir() else None,
                      pred if pred is None or pred.is_dir() else None, model_id, profile, head, **values_dir)


def _existing_dir(path: str | Path, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"{what} directory not found: {path}")
    return p


def parse_device(device: str | torch.device) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N', checked against what this machine has."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but no CUDA device is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def check_threads(threads: int | None) -> None:
    """torch intra-op threads: None, or an integer in [1, this machine's CPUs]."""
    import os

    cpus = os.cpu_count() or 1
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= cpus):
        raise ValueError(f"threads must be an integer in [1, {cpus}] (this machine's CPUs) or None, got {threads!r}")


def set_cpu_threads(threads: int | None, device: torch.device) -> None:
    """torch intra-op threads for CPU runs (None: leave torch's setting alone).

    One thread is the default of the CLI and the API: a small model gains nothing from more, and on a
    shared CPU OpenMP barriers stall (a 2-core machine ran 2.7-49 tok/s with torch's default against
    207 tok/s with one thread). The setting is process-wide, as torch's is.
    """
    check_threads(threads)
    if threads is not None and device.type == "cpu" and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def check_target_dir(path: Path) -> None:
    """config.json, safetensors headers and a supported architecture, before anything else is looked at."""
    from .models.arch import arch_spec
    from .models.checkpoint import check_safetensors_dir

    config = check_safetensors_dir(path, what="target checkpoint")
    arch_spec((config.get("architectures") or ["<missing 'architectures' in config.json>"])[0])
    check_checkpoint_json(path)


# The JSON files transformers reads beside config.json. It skips a generation_config.json it cannot
# parse without a word (and the eos ids come from it), and fails on a broken tokenizer.json with a JSON
# error that names no file: each is checked here, its error naming the file.
CHECKPOINT_JSON = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def check_checkpoint_json(path: Path) -> None:
    """Each of CHECKPOINT_JSON present in `path` holds a JSON object; generation_config.json's eos_token_id
    is a token id or a list of them."""
    import json

    for name in CHECKPOINT_JSON:
        file = path / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{file} is not UTF-8 text (byte {e.start}: {e.reason})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON (line {e.lineno} column {e.colno}: {e.msg}); fix or "
                             "remove it") from None
        if not isinstance(data, dict):
            raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
        eos = data.get("eos_token_id") if name == "generation_config.json" else None
        ids = eos if isinstance(eos, list) else [eos]
        if eos is not None and not (ids and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in ids)):
            raise ValueError(f"{file}: eos_token_id must be a token id or a list of token ids, got {eos!r}")


def check_tree_fits_drafter(tree: TreeConfig, draft: Path) -> None:
    """topk children per node are distinct tokens: at most the drafter's vocabulary."""
    from .models.checkpoint import read_config_json

    cfg = read_config_json(draft, "EAGLE-3 drafter")
    vocab = cfg.get("draft_vocab_size") or cfg.get("vocab_size")
    if isinstance(vocab, int) and tree.topk > vocab:
        raise ValueError(f"tree topk {tree.topk} exceeds the drafter's vocabulary of {vocab} tokens (siblings are "
                         f"distinct tokens: topk <= {vocab})")


def device_name(device: torch.device | str) -> str:
    """The device string cost profiles are keyed by: 'cpu' or 'cuda:<GPU name>'."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def default_tree(cost_profile, paths: ModelPaths) -> TreeConfig:
    """The tree when none is given: the one the cost profile in use (`cost_profile`, else the model's own) was
    measured with, so that a model ships the drafting shape tuned for it with its profile (a profile only
    prices that tree); EAGLE's 4,8,32 where no profile names one."""
    if isinstance(cost_profile, CostTable):
        measured = cost_profile.tree
    elif isinstance(cost_profile, str) and cost_profile.startswith("roofline"):
        measured = None
    else:
        path = Path(cost_profile) if cost_profile is not None else paths.cost_profile
        try:
            measured = CostTable.load(path).tree if path.is_file() else None
        except ValueError:  # a broken profile is reported by load_cost_profile, where a policy needs it
            measured = None
    return TreeConfig(*measured) if measured else TreeConfig()


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
            f"`moespec profile --model {paths.model_id if paths.model_id in SHIPPED_MODELS else paths.target}`, pass "
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


def load_predictor(predictor, paths: ModelPaths, target, drafter=None):
    """The expert predictor adapter the engine calls each step; `drafter` is the loaded EAGLE-3 drafter
    (None for the n-gram drafter), which a draft-head predictor must match."""
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
        _check_head_drafter(head, paths.predictor, drafter)
        return HeadExperts(head.to(target.device), target.input_embeddings(), target.num_experts)
    from .models.predictor import ExpertPredictor

    model = ExpertPredictor.load(paths.predictor)
    model.check_target(len(target.moe_layers), target.num_experts, target.experts_per_token, target.vocab_size)
    return LearnedExperts(model.to(target.device) if hasattr(model, "to") else model, target.num_experts)


def _check_head_drafter(head, path: Path, drafter) -> None:
    """A draft-head predictor reads the EAGLE-3 drafter's per-node hidden: refuse any other pairing now,
    not mid-generation."""
    if drafter is None:
        raise ValueError(f"the expert predictor at {path} is a head on an EAGLE-3 drafter's hidden state; the n-gram "
                         "drafter has none (use an EcoSpec-style predictor directory or predictor='oracle')")
    if head.config.hidden_size != drafter.config.hidden_size:
        raise ValueError(f"the expert predictor at {path} reads a drafter hidden state of width "
                         f"{head.config.hidden_size}, but the drafter's is {drafter.config.hidden_size}: train a head "
                         "for this drafter, or pass an EcoSpec-style predictor directory or predictor='oracle'")


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
