"""`moespec build`: write an engine directory for TensorRT-LLM's PyTorch backend.

    moespec build --model gpt-oss-120b --checkpoint DIR --draft-model DIR --policy joint \\
        --tp 8 --ep 8 --max-batch-size 8 --verify-lengths 4,8,16,32 --out engines/gpt-oss-120b

Writes profiles/verify_<v>.yaml (one extra_llm_api_options per verify length),
llm_api_options.yaml (the largest profile), moespec.json and README.md. With
tensorrt_llm importable on a GPU it then profiles C(k) per profile (forced
acceptance) into cost_profile.json; --dry-run stops before that. Bad input exits
with code 2 and one line on stderr; a missing tensorrt_llm (without --dry-run)
exits with code 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
from pathlib import Path
from typing import Sequence

import yaml

from ... import __version__ as MOESPEC_VERSION
from .config import (
    COST_PROFILE_JSON,
    MAIN_OPTIONS_YAML,
    MOESPEC_JSON,
    POLICIES,
    EngineSpec,
    VerifyProfile,
    check_parallel,
    check_tree,
    draft_mode,
    llm_api_options,
    make_profiles,
    parse_verify_lengths,
)
from .presets import PRESETS, ModelPreset, TreeDefaults, check_checkpoint_matches, load_hf_config, resolve_model
from .selection import EAGER_POLICIES
from .schema import MOE_BACKENDS
from .version import TRTLLM_LINES, UnsupportedTensorRTLLMVersion, engine_range, trtllm_available

EXIT_BAD_INPUT = 2
EXIT_NO_TRTLLM = 1


class BuildError(ValueError):
    """Bad build input; the message is the one line the user sees."""


def add_build_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", required=True, help=f"preset ({', '.join(sorted(PRESETS))}) or a local HF directory")
    parser.add_argument("--checkpoint", help="local target checkpoint directory (default: --model when it is a directory)")
    parser.add_argument("--draft-model", required=True, help="local EAGLE-3 drafter directory")
    parser.add_argument("--policy", default="joint", choices=POLICIES, help="node selection policy")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: preset's recommendation)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--ep", type=int, default=None, help="MoE expert-parallel size (default: preset's recommendation)")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--verify-lengths", default=None, help="comma list of verified draft-node counts, e.g. 4,8,16,32")
    parser.add_argument("--steps", type=int, default=None, help="drafting steps (default 4)")
    parser.add_argument("--topk", type=int, default=None, help="children kept per step (default 8)")
    parser.add_argument("--max-draft-tokens", type=int, default=None, help="largest verified node count (default 32)")
    parser.add_argument("--max-seq-len", type=int, default=None)
    parser.add_argument("--predictor", default=None, help="expert predictor checkpoint (for ecospec/joint)")
    parser.add_argument("--trtllm-line", default="dynamic-tree", choices=sorted(TRTLLM_LINES),
                        help="TensorRT-LLM line to target: 'dynamic-tree' (a release or commit with PR #13081: tree "
                             "profiles, our selection inside TensorRT-LLM) or '1.2' (1.2.x: linear EAGLE-3 profiles)")
    parser.add_argument("--moe-backend", default=None, choices=MOE_BACKENDS,
                        help="TensorRT-LLM moe_config.backend (default: TensorRT-LLM's choice); e.g. TRITON for "
                             "GPT-OSS on Hopper")
    parser.add_argument("--out", required=True, help="engine directory to write")
    parser.add_argument("--dry-run", action="store_true", help="write the configuration only; no TensorRT-LLM, no profiling")
    return parser


def _existing_dir(path: str | None, what: str) -> str | None:
    if path is None:
        return None
    p = Path(path)
    if not p.is_dir():
        raise BuildError(f"{what} {path} does not exist or is not a directory (nothing is downloaded)")
    if not (p / "config.json").is_file():
        raise BuildError(f"{what} {path} has no config.json")
    return str(p.resolve())


def _resolve_inputs(args: argparse.Namespace) -> tuple[ModelPreset, str | None, str, TreeDefaults]:
    try:
        preset = resolve_model(args.model)
    except FileNotFoundError as e:
        raise BuildError(str(e)) from None
    checkpoint = args.checkpoint or (args.model if args.model not in PRESETS else None)
    checkpoint = _existing_dir(checkpoint, "checkpoint")
    if checkpoint is not None and args.model in PRESETS:
        check_checkpoint_matches(preset, checkpoint)
    draft = _existing_dir(args.draft_model, "draft model")
    check_drafter_fits(preset, draft)
    tree = TreeDefaults(
        steps=args.steps or preset.tree.steps,
        topk=args.topk or preset.tree.topk,
        max_draft_tokens=args.max_draft_tokens or preset.tree.max_draft_tokens,
    )
    return preset, checkpoint, draft, check_tree(tree)


def check_drafter_fits(preset: ModelPreset, draft: str) -> None:
    """BuildError unless `draft` is an EAGLE-3 drafter for this target (architecture, width, vocabulary,
    pre-norm hidden states).

    The drafter's fc reads 3 * target_hidden_size features and its embedding is the
    target's vocabulary; a drafter of another width (or the target directory itself)
    would fail only on the GPUs. A drafter whose config asks TensorRT-LLM to hand on its
    post-norm hidden state (`eagle_config.return_hidden_post_norm`, or `norm_output`:
    `Eagle3DraftModel`, tensorrt_llm/_torch/models/modeling_speculative.py @
    00679c66c3e38f6d2651ad0a5bef0f94d862e36c, then returns (hidden, hidden) instead of
    (post-norm, pre-norm)) feeds back another state than the one our draft-head expert
    predictor and our PyTorch drafter use (pre-norm), so it is refused.
    """
    from ...models.eagle3 import Eagle3Config

    raw = load_hf_config(draft)
    try:
        cfg = Eagle3Config.from_dict(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise BuildError(f"draft model {draft}: {e}") from None
    eagle_config = raw.get("eagle_config") or {}
    if (isinstance(eagle_config, dict) and eagle_config.get("return_hidden_post_norm")) or raw.get("norm_output"):
        raise BuildError(f"draft model {draft} returns post-norm hidden states (eagle_config.return_hidden_post_norm or "
                         "norm_output); the expert predictor head and the PyTorch drafter need pre-norm ones")
    if cfg.target_hidden_size != preset.hidden_size:
        raise BuildError(f"draft model {draft} was made for a target of hidden size {cfg.target_hidden_size} "
                         f"(target_hidden_size, or hidden_size when absent); {preset.name} has {preset.hidden_size}")
    if cfg.vocab_size != preset.vocab_size:
        raise BuildError(f"draft model {draft} has vocab_size {cfg.vocab_size}; {preset.name} has {preset.vocab_size}")


def plan_engine(args: argparse.Namespace) -> EngineSpec:
    """Validate the arguments and compute everything the engine directory records."""
    preset, checkpoint, draft, tree = _resolve_inputs(args)
    if preset.architecture == "GptOssForCausalLM" and args.pp > 1:
        # GptOssForCausalLM.__init__ asserts mapping.pp_size == 1 (tensorrt_llm/_torch/models/modeling_gpt_oss.py
        # @ 7924c7f1d3b4a3286b62c13fc890900295dc39cb): refuse here, not as an assertion on every GPU rank.
        raise BuildError(f"--pp {args.pp}: TensorRT-LLM's GPT-OSS does not support pipeline parallelism (pp must be 1)")
    parallel = check_parallel(args.tp or preset.recommended_tp, args.pp, args.ep or preset.recommended_ep, preset.num_experts)
    lengths = parse_verify_lengths(args.verify_lengths, tree.max_draft_tokens)
    mode = draft_mode(preset, tree, args.trtllm_line)
    if args.predictor is not None and not Path(args.predictor).exists():
        raise BuildError(f"predictor {args.predictor} does not exist")
    if args.max_batch_size < 1:
        raise BuildError(f"--max-batch-size must be positive, got {args.max_batch_size}")
    return EngineSpec(
        model=preset,
        checkpoint=checkpoint,
        draft_model=draft,
        policy=args.policy,
        mode=mode,
        tree=tree,
        parallel=parallel,
        max_batch_size=args.max_batch_size,
        profiles=make_profiles(lengths, tree, mode),
        llm_api_options=MAIN_OPTIONS_YAML,
        cost_profile=None,
        predictor=str(Path(args.predictor).resolve()) if args.predictor else None,
        dtype=preset.dtype,
        versions={"trtllm_moespec": MOESPEC_VERSION, "tensorrt_llm_range": engine_range(mode),
                  "tensorrt_llm": None},
        dry_run=bool(args.dry_run),
        max_seq_len=args.max_seq_len,
        moe_backend=args.moe_backend,
    )


def profile_options(spec: EngineSpec, profile: VerifyProfile) -> dict:
    """The extra_llm_api_options mapping of one profile (validated)."""
    return llm_api_options(spec.model, spec.tree, spec.parallel, profile, draft_dir=spec.draft_model, mode=spec.mode,
                           max_batch_size=spec.max_batch_size, max_seq_len=spec.max_seq_len,
                           cuda_graphs=spec.policy not in EAGER_POLICIES, moe_backend=spec.moe_backend)


def engine_readme(spec: EngineSpec, command: str) -> str:
    lengths = ", ".join(str(p.verify_length) for p in spec.profiles)
    lines = [
        f"# MoESpec engine: {spec.model.name}",
        "",
        f"Built by trtllm_moespec {spec.versions['trtllm_moespec']} for tensorrt_llm {spec.versions['tensorrt_llm_range']}"
        f" (tensorrt_llm used: {spec.versions['tensorrt_llm'] or 'none'}).",
        "",
        "Command:",
        "",
        f"    {command}",
        "",
        f"- target checkpoint: {spec.checkpoint or '(not given; required to run)'}",
        f"- EAGLE-3 drafter: {spec.draft_model}",
        f"- policy: {spec.policy}; tree: steps={spec.tree.steps}, topk={spec.tree.topk}, "
        f"max_draft_tokens={spec.tree.max_draft_tokens}; verify-length profiles: {lengths}",
        f"- parallel: tp={spec.parallel.tp} pp={spec.parallel.pp} ep={spec.parallel.ep} "
        f"moe_tp={spec.parallel.moe_tp}; max batch size {spec.max_batch_size}",
        f"- `{MAIN_OPTIONS_YAML}`: TensorRT-LLM `extra_llm_api_options` of the largest profile; "
        "`profiles/verify_<v>.yaml`: one per verify length (CUDA graphs are keyed by draft length).",
    ]
    if spec.dry_run:
        lines.append(f"- DRY RUN: no `{COST_PROFILE_JSON}`. Policies that need C(k) (evict, joint) need a cost profile: "
                     "run `moespec build` without --dry-run on the GPUs, or give the PyTorch engine one.")
    else:
        lines.append(f"- `{COST_PROFILE_JSON}`: C(k) profiled with forced acceptance on this machine.")
    if spec.policy in EAGER_POLICIES:
        lines.append(f"- `cuda_graph_config: null`: policy {spec.policy} selects in eager PyTorch (host syncs), which "
                     "a captured CUDA graph cannot contain; evict, ecospec, joint and eagle3 select on the device.")
    if spec.mode == "chain":
        lines += [
            "",
            "## Chain mode (sliding-window attention)",
            "",
            "TensorRT-LLM's EAGLE-3 dynamic tree does not support sliding-window attention, which this model uses. "
            "This engine therefore drafts a linear EAGLE-3 chain (`use_dynamic_tree: false`, "
            "`max_draft_len` = the profile's verify length); our selection chooses how long a prefix of the chain "
            "to verify (EVICT on a chain). Status: that choice exists as tested functions, but TensorRT-LLM's "
            "linear worker is not replaced yet, so on TensorRT-LLM each profile verifies its whole chain; the "
            "PyTorch engine runs the full tree (its attention masks handle sliding windows).",
        ]
    return "\n".join(lines) + "\n"


def write_engine_dir(spec: EngineSpec, out: Path, command: str) -> list[Path]:
    """Write YAMLs, moespec.json and README.md; returns the written paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for p in spec.profiles:
        path = out / p.options_yaml
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(profile_options(spec, p), sort_keys=False))
        written.append(path)
    main = out / MAIN_OPTIONS_YAML
    main.write_text(yaml.safe_dump(profile_options(spec, spec.profiles[-1]), sort_keys=False))
    (out / MOESPEC_JSON).write_text(json.dumps(spec.to_json(), indent=2) + "\n")
    (out / "README.md").write_text(engine_readme(spec, command))
    return written + [main, out / MOESPEC_JSON, out / "README.md"]


def _command_line(args: argparse.Namespace) -> str:
    """The build command as a shell line, rebuilt from the parsed arguments."""
    parts = ["moespec", "build"]
    for key, value in sorted(vars(args).items()):
        if key.startswith("_") or value is None or value is False or key in ("command", "func"):
            continue
        flag = "--" + key.replace("_", "-")
        parts += [flag] if value is True else [flag, str(value)]
    return " ".join(shlex.quote(p) for p in parts)


def build_engine(args: argparse.Namespace) -> int:
    """Run a build from parsed arguments; returns the process exit code."""
    command = _command_line(args)
    try:
        spec = plan_engine(args)
        if not args.dry_run and spec.checkpoint is None:
            raise BuildError("a real build needs --checkpoint (a local target checkpoint directory)")
    except (BuildError, ValueError, FileNotFoundError) as e:
        print(f"moespec build: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    out = Path(args.out)
    if args.dry_run:
        write_engine_dir(spec, out, command)
        print(f"dry run: wrote {out} (llm_api_options, {len(spec.profiles)} profiles, {MOESPEC_JSON}, README.md); "
              f"no {COST_PROFILE_JSON}: profiling needs TensorRT-LLM on the GPUs")
        return 0
    if not trtllm_available():
        print("moespec build: error: tensorrt_llm is not importable here (it needs a CUDA GPU machine); "
              "rerun with --dry-run to write the configuration only", file=sys.stderr)
        return EXIT_NO_TRTLLM
    return _profile_build(spec, out, command)


def _profile_build(spec: EngineSpec, out: Path, command: str) -> int:  # GPU machines (imports tensorrt_llm)
    """The real build: check the installed TensorRT-LLM, then write and profile (rank 0; other ranks serve it)."""
    from .profile import _trtllm_measure, prepare_profiling_process, profile_engine
    from .reach import leader_mpi_session, mpi_rank_and_size, serve_mpi_worker
    from .version import check_installed

    try:  # before anything is written: the installed version must run this engine's mode and range
        version = check_installed(spec.mode, spec.versions["tensorrt_llm_range"])
    except UnsupportedTensorRTLLMVersion as e:
        print(f"moespec build: error: {e}", file=sys.stderr)
        return EXIT_NO_TRTLLM
    rank, world_size = mpi_rank_and_size()
    try:
        prepare_profiling_process(spec, world_size)
    except ValueError as e:
        print(f"moespec build: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if rank != 0:
        serve_mpi_worker()
        return 0
    session = leader_mpi_session(world_size)
    measure = functools.partial(_trtllm_measure, mpi_session=session) if session is not None else None
    write_engine_dir(spec, out, command)
    spec = profile_engine(spec, out, measure=measure, version=version, world_size=world_size)
    write_engine_dir(spec, out, command)
    print(f"wrote {out} with {COST_PROFILE_JSON}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_build_arguments(argparse.ArgumentParser(prog="moespec build", description=__doc__.split("\n")[0]))
    return build_engine(parser.parse_args(argv))
