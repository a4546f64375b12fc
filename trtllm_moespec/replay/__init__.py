"""`moespec replay`: record live decoding steps with the target's verdict on every draft node,
then score selection policies and value models offline on exactly those steps.

    moespec replay record --model moespec-tiny --datasets humaneval,mt_bench,gsm8k --num-prompts 8 \\
        --max-tokens 64 --out runs/replay/heldout.safetensors
    moespec replay score FILE --policies eagle3,evict,ecospec,joint,coverage --values raw,calibrated,head \\
        --cost-profile PROFILE [--cost fit|table] [--hindsight] [--true-experts] [--json OUT --markdown OUT]
    moespec replay rank FILE --values raw,calibrated,head --k 1,2,4,8,16 [--json OUT --markdown OUT]
    moespec replay fit-calibrator FILE [FILE ...] --out value_calibrator.json
    moespec replay tune FILE [FILE ...] --policy ecospec --option budget --grid 1,2,3,4,5,6,7,8,10,12 \
        [--out policy_defaults.json] [--json OUT --markdown OUT]

Records hold the full draft tree (tokens, parents, q), the live values, predicted and true
expert sets, the drafter's node features and the target's acceptance of every node (one
extra peek forward per step, which the live run never sees). Bad input: one line, exit 2;
output paths are checked before anything runs (outfiles.check_writable), and a report whose
final write fails goes to the temporary directory or stdout, named on stderr (exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..assets import DEFAULT_MODEL
from ..bench import _csv  # one parser for comma-separated options

__all__ = ["main"]


def build_parser(prog: str = "moespec replay") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    r = sub.add_parser("record", help="decode live and record every step with the target's verdicts")
    r.add_argument("--model", default=DEFAULT_MODEL)
    r.add_argument("--draft-model", default=None)
    r.add_argument("--policy", default="eagle3", help="the live policy (default eagle3: the fixed tree)")
    r.add_argument("--values", default="calibrated", help="the live value model of a cost-aware policy")
    r.add_argument("--tree", default=None, help="steps,topk,max_draft_tokens (default: the model's)")
    r.add_argument("--cost-profile", default=None)
    r.add_argument("--datasets", type=_csv(str), default=("humaneval", "mt_bench", "gsm8k"))
    r.add_argument("--num-prompts", type=int, default=8, help="prompts per dataset")
    r.add_argument("--skip-prompts", type=int, default=0, help="start after this many prompts of each dataset "
                   "(the bench uses the first 8: record training data with --skip-prompts 8)")
    r.add_argument("--max-tokens", type=int, default=64)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-hidden", action="store_true", help="do not store the drafter's node features")
    r.add_argument("--out", required=True)
    r.add_argument("--threads", type=int, default=1)
    for name, helptext in (("score", "score policies offline"), ("rank", "ranking quality of value models")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("file")
        s.add_argument("--values", type=_csv(str), default=("raw", "calibrated"))
        s.add_argument("--calibrator", default=None, help="calibrator prior JSON (default: the model's own)")
        s.add_argument("--json", default=None)
        s.add_argument("--markdown", default=None)
    sc = sub.choices["score"]
    sc.add_argument("--policies", type=_csv(str), default=("eagle3", "evict", "ecospec", "joint", "coverage"))
    sc.add_argument("--cost-profile", default=None, help="cost_profile.json (default: the model's own)")
    sc.add_argument("--cost", choices=["fit", "table"], default="fit",
                    help="charge C(k, U) with the true expert union (fit, default) or the profiled C(k) (table)")
    sc.add_argument("--hindsight", action="store_true",
                    help="also score each value model's order with the best prefix per step in hindsight: the "
                         "bound of any stop rule on those values (the rest of the gap to the oracle is ranking)")
    sc.add_argument("--true-experts", action="store_true",
                    help="also score the expert-aware policies (ecospec, joint) on the target's true routing of "
                         "every node: a perfect expert predictor, the most their expert term can give")
    rk = sub.choices["rank"]
    rk.add_argument("--k", type=_csv(int), default=(1, 2, 4, 8, 16))
    f = sub.add_parser("fit-calibrator", help="fit the value calibrator prior from records")
    f.add_argument("files", nargs="+")
    f.add_argument("--out", required=True)
    f.add_argument("--prior-weight", type=float, default=50.0)
    f.add_argument("--num-depths", type=int, default=4)
    f.add_argument("--num-ranks", type=int, default=3)
    f.add_argument("--no-copy", action="store_true", help="do not split groups by the context-copy feature")
    t = sub.add_parser("tune", help="choose a policy option by the mean replayed speedup over data sets (replay/tune.py)")
    t.add_argument("files", nargs="+", help="records of prompts the benchmarks do not use (--skip-prompts)")
    t.add_argument("--policy", default="ecospec")
    t.add_argument("--option", default="budget")
    t.add_argument("--grid", type=_csv(number), default=(1, 2, 3, 4, 5, 6, 7, 8, 10, 12),
                   help="the option's candidate values (integers, or numbers such as coverage's rho 0.5,0.7,0.9)")
    t.add_argument("--values", default="calibrated", help="the value model the policy ranks on")
    t.add_argument("--calibrator", default=None, help="calibrator prior JSON (default: the model's own)")
    t.add_argument("--cost-profile", default=None, help="cost_profile.json (default: the model's own)")
    t.add_argument("--out", default=None, help="policy_defaults.json to write (an existing one keeps its other "
                   "policies); default: report only")
    t.add_argument("--json", default=None)
    t.add_argument("--markdown", default=None)
    return p


def number(text: str) -> int | float:
    """A grid value: an integer where it reads as one (a budget), else a float (a threshold)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def main(argv: list[str] | None = None, prog: str = "moespec replay") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    import torch

    torch.set_num_threads(getattr(args, "threads", 1))  # tiny tensors: more threads only stall on a shared CPU
    try:
        _check_outputs(args)
        return {"record": _record, "score": _score, "rank": _rank, "fit-calibrator": _fit, "tune": _tune}[args.action](args, argv)
    except (ValueError, FileNotFoundError) as e:
        from ..cli import flag_message

        print(f"{prog}: error: {flag_message(str(e), build_parser(prog))}", file=sys.stderr)
        return 2


def _check_outputs(args) -> None:
    """Every output path of the action, before it records or scores anything."""
    from ..outfiles import check_writable

    for flag in ("out", "json", "markdown"):
        if getattr(args, flag, None) is not None:
            check_writable(getattr(args, flag), f"--{flag}")


def _record(args, argv) -> int:
    import torch
    from tqdm.auto import tqdm

    from ..api import LLM, SamplingParams
    from ..bench.datasets import encode_prompt, load_prompts
    from ..engine.config import TreeConfig
    from .record import record

    if args.num_prompts < 1 or args.skip_prompts < 0 or args.max_tokens < 1:
        raise ValueError("--num-prompts and --max-tokens must be positive, --skip-prompts >= 0")
    torch.set_num_threads(args.threads)
    tree = TreeConfig.parse(args.tree) if args.tree is not None else None
    prompts = [p for ds in args.datasets for p in load_prompts(ds, args.skip_prompts + args.num_prompts)[args.skip_prompts:]]
    llm = LLM(model=args.model, draft_model=args.draft_model, policy=args.policy, tree=tree, values=args.values,
              cost_profile=args.cost_profile)
    limit = llm.target.max_position_embeddings - args.max_tokens
    ids = [encode_prompt(p.text, llm.tokenizer, llm.target.vocab_size, limit) for p in prompts]
    meta = {"model": args.model, "draft_model": args.draft_model, "policy": args.policy, "values": args.values,
            "tree": list(llm.tree.as_tuple()), "temperature": args.temperature, "max_tokens": args.max_tokens,
            "prompts": [f"{p.dataset}:{p.prompt_id}" for p in prompts], "command": "moespec replay " + " ".join(argv),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    t0 = time.time()
    # A per-prompt seed keeps T > 0 records reproducible.
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                             seed=None if args.temperature == 0 else args.seed + i) for i in range(len(ids))]
    with tqdm(total=len(ids), desc="record") as bar:
        records, _ = record(llm, ids, params, meta, keep_hidden=not args.no_hidden, progress=bar)
    from ..outfiles import atomic_path

    with atomic_path(args.out) as tmp:  # safetensors writes 0600 files: atomic_path gives the usual mode
        records.save(tmp)
    print(f"recorded {records.num_steps} steps of {len(ids)} prompts in {time.time() - t0:.0f}s -> {args.out}")
    return 0


def _tune(args, argv) -> int:
    from ..assemble import build_policy
    from ..core.cost import CostTable
    from ..engine.config import TreeConfig
    from ..policy_defaults import PolicyDefaults, TunedOptions
    from ..resolve import resolve_model
    from .records import ReplayFile
    from .score import StepCost
    from .tune import best_point, score_grid

    stems = [Path(f).stem for f in args.files]  # each file's label in the report: its name, numbered if names repeat
    labels = stems if len(set(stems)) == len(stems) else [f"{i}:{stem}" for i, stem in enumerate(stems)]
    files = {label: ReplayFile.load(f) for label, f in zip(labels, args.files)}
    first = next(iter(files.values())).meta
    for name, rf in files.items():
        if (rf.meta["model"], rf.meta["tree"]) != (first["model"], first["tree"]):
            raise ValueError(f"records {name} are of {rf.meta['model']} tree {rf.meta['tree']}, the first of "
                             f"{first['model']} tree {first['tree']}: tune on one model and tree at a time")
    tree = TreeConfig(*first["tree"])
    paths = resolve_model(first["model"], first.get("draft_model"))
    table = CostTable.load(args.cost_profile or paths.cost_profile, override=True)
    cost = StepCost(table, table.expert_model is not None)
    valued = {name: (rf, _value_models((args.values,), rf, args.calibrator)[args.values]) for name, rf in files.items()}
    points = score_grid(valued, lambda v: build_policy(args.policy, tree, table, {args.option: v}), tuple(args.grid),
                        cost, tree.max_draft_tokens)
    best = best_point(points)
    command = "moespec replay " + " ".join(argv)
    record = {"made_by": command, "criterion": "mean replayed speedup over data sets (replay/tune.py)",
              "values": args.values, "records": [rf.meta.get("command") for rf in files.values()],
              "grid": [p.as_dict() for p in points]}
    if args.out is not None:
        out = Path(args.out)
        kept = PolicyDefaults.load(out) if out.is_file() else PolicyDefaults(paths.model_id, {})
        if kept.model_id != paths.model_id:
            raise ValueError(f"{out} holds options tuned for {kept.model_id!r}, these records are of {paths.model_id!r}")
        tuned = TunedOptions({args.option: best.value}, tree.as_tuple(), table.device, record)
        PolicyDefaults(paths.model_id, {**kept.policies, args.policy: tuned}, kept.values).save(out)
    report = {"command": command, "policy": args.policy, "option": args.option, "best": best.value,
              "grid": record["grid"], "cost_profile": table.method}
    groups = list(points[0].speedup)
    lines = [f"| {args.option} | mean speedup | " + " | ".join(groups) + " | tokens/step | verified/step |",
             "|---" * (len(groups) + 4) + "|"]
    lines += [f"| {p.value}{' (best)' if p is best else ''} | {p.mean_speedup:.3f} | "
              + " | ".join(f"{p.speedup[g]:.3f}" for g in groups)
              + f" | {p.tokens_per_step:.2f} | {p.verified_per_step:.1f} |" for p in points]
    return _emit(report, lines, args)


def _load(args):
    from .records import ReplayFile

    return ReplayFile.load(args.file)


def _value_models(kinds, records, calibrator_path):
    from ..core.values import CalibratedValues, Calibrator, RawValues
    from ..resolve import load_value_model, resolve_model

    paths = resolve_model(records.meta["model"], records.meta.get("draft_model"))
    models, target = {}, None
    for kind in kinds:
        if kind == "calibrated" and calibrator_path:
            models[kind] = CalibratedValues(Calibrator.load(calibrator_path))
        elif kind == "raw":
            models[kind] = RawValues()
        else:
            if kind == "head" and target is None:
                from ..models.target import TargetModel

                target = TargetModel.load(paths.target)
            models[kind] = load_value_model(kind, paths, target)
    return models


def _score(args, argv) -> int:
    from ..core.policies import POLICIES
    from ..resolve import resolve_model
    from .score import StepCost, replay_policy
    from ..assemble import build_policy
    from ..core.cost import CostTable
    from ..engine.config import TreeConfig
    from ..policy_defaults import with_tuned_options

    records = _load(args)
    tree = TreeConfig(*records.meta["tree"])
    paths = resolve_model(records.meta["model"], records.meta.get("draft_model"))
    table = CostTable.load(args.cost_profile or paths.cost_profile, override=True)
    if args.cost == "fit" and table.expert_model is None:
        raise ValueError("--cost fit needs a cost profile with an expert cost fit (C(k, U))")
    cost = StepCost(table, args.cost == "fit")
    models = _value_models(args.values, records, args.calibrator)
    rows = []
    for name in ("eagle3",) + tuple(p for p in args.policies if p != "eagle3"):
        if name not in POLICIES or name in ("ar", "oracle"):
            raise ValueError(f"replay scores drafting policies ({', '.join(sorted(set(POLICIES) - {'ar', 'oracle'}))}); "
                             f"got {name!r} (the oracle selection is always scored)")
        # replay prices no predictor time, so joint is scored with its expert term (the selection rule itself);
        # a policy's options tuned for the model apply as they do live
        options = with_tuned_options(name, {"expert_term": True} if name == "joint" else {}, paths.policy_defaults,
                                     paths.model_id, tree.as_tuple(), table.device)
        policy = build_policy(name, tree, table, options)
        for kind in (args.values if policy.uses_values else ("raw",)):
            for true in (False, True) if args.true_experts and policy.reads_experts else (False,):
                tags = ([f"values={kind}"] if policy.uses_values else []) + (["experts=true"] if true else [])
                label = f"{name}[{','.join(tags)}]" if tags else name
                tally, _ = replay_policy(records, label, policy, models[kind] if policy.uses_values else None, cost,
                                         tree.max_draft_tokens, true_experts=true)
                rows.append(tally.as_dict())
    if args.hindsight:  # the value order alone (evict's), stopped where the target's verdicts say is best
        order_only = build_policy("evict", tree, table, {})
        for kind in args.values:
            tally, _ = replay_policy(records, f"hindsight[values={kind}]", order_only, models[kind], cost,
                                     tree.max_draft_tokens, hindsight=True)
            rows.append(tally.as_dict())
    oracle, _ = replay_policy(records, "oracle", None, None, cost, tree.max_draft_tokens)
    rows.append(oracle.as_dict())
    base, top = rows[0]["tokens_per_s"], oracle.as_dict()["tokens_per_s"]
    for r in rows:
        r["vs_eagle3"], r["vs_oracle"] = r["tokens_per_s"] / base, r["tokens_per_s"] / top
    report = {"command": "moespec replay " + " ".join(argv), "file": args.file, "records": records.meta,
              "num_steps": records.num_steps, "cost": args.cost, "cost_profile": table.method, "results": rows}
    lines = ["| policy | tokens/step | verified/step | tokens per s of cost | vs eagle3 | vs oracle |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['label']} | {r['tokens_per_step']:.2f} | {r['verified_per_step']:.1f} | {r['tokens_per_s']:.1f} | "
              f"{r['vs_eagle3']:.3f} | {r['vs_oracle']:.3f} |" for r in rows]
    return _emit(report, lines, args)


def _rank(args, argv) -> int:
    from .score import ranking

    records = _load(args)
    models = _value_models(args.values, records, args.calibrator)
    table = ranking(records, models, tuple(args.k), records.meta["tree"][2])
    lines = ["| values | " + " | ".join(f"top-{k}" for k in args.k) + " |", "|---" * (len(args.k) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{d[k]:.2f}" for k in args.k) + " |" for name, d in table.items()]
    report = {"command": "moespec replay " + " ".join(argv), "file": args.file, "records": records.meta,
              "num_steps": records.num_steps, "accepted_in_top_k": table}
    return _emit(report, lines, args)


def _fit(args, argv) -> int:
    import numpy as np

    from ..core.values import MIN_COND, Calibrator
    from .records import ReplayFile
    from .score import true_values

    scheme = Calibrator(prior_weight=args.prior_weight, num_depths=args.num_depths, num_ranks=args.num_ranks,
                        copy=not args.no_copy)
    samples: dict[float, list] = {}
    for path in args.files:
        rf = ReplayFile.load(path)
        for s in range(rf.num_steps):
            step = rf.step(s)
            v = step.tree.valid[0].numpy()
            # A node is a trial of c(v) = P(target accepts v | its parent accepted), counted with the weight
            # that its parent is accepted (full tree, from the peek: 0 or 1 at T=0). Nodes under a rejected
            # parent are not trials: after a wrong token the target's next choice says nothing live. (A
            # rejected path's value is at most MIN_COND, the floor of `path_values`: such parents are dropped.)
            parent = step.tree.parents[0].numpy()
            reach = true_values(step)[0].double().numpy()
            weight = np.where(parent >= 0, reach[np.maximum(parent, 0)], 1.0)
            keep = v & (weight > MIN_COND)
            samples.setdefault(step.temperature, []).append(
                (scheme.node_groups(step.tree, step.context)[0][keep], step.tree.draft_probs[0].double().numpy()[keep],
                 step.target_local[0].double().numpy()[keep], weight[keep]))
    if not samples:
        raise ValueError("no recorded steps to fit a calibrator on")
    merged = {t: tuple(np.concatenate(x) for x in zip(*parts)) for t, parts in samples.items()}
    cal = scheme.fit(merged, source="moespec replay " + " ".join(argv))
    from ..outfiles import atomic_path

    with atomic_path(args.out) as tmp:
        cal.save(tmp)
    print(f"calibrator over {sum(len(m[0]) for m in merged.values())} trials (nodes under an accepted parent), "
          f"{cal.num_groups} groups, "
          f"temperatures {sorted(merged)} -> {args.out}")
    return 0


def _emit(report: dict, lines: list[str], args) -> int:
    """Print the table and the JSON summary line; write --json / --markdown. Returns the exit code: 1
    when a report could not be written where asked (it went elsewhere, said on stderr)."""
    from ..outfiles import save_report

    print("\n".join(lines))
    where_asked = True
    if args.json:
        path = Path(args.json)
        where_asked &= save_report(path, json.dumps(report, indent=1) + "\n", "--json", "moespec replay") == path
    if args.markdown:
        path, text = Path(args.markdown), f"Command: `{report['command']}`\n\n" + "\n".join(lines) + "\n"
        where_asked &= save_report(path, text, "--markdown", "moespec replay") == path
    print(json.dumps({k: v for k, v in report.items() if k not in ("records",)}, default=str)[:2000])
    return 0 if where_asked else 1
