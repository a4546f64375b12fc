"""How much of the target's greedy output a reduced draft vocabulary (SpecForge d2t/t2d) covers.

The vocabulary of size N is the N tokens the target predicts most often (argmax) on
calibration text: training files of the embedded models' corpus (the Python standard library).
Coverage is measured on (a) the target's argmax over held-out files and (b) the tokens the
target really emits greedily on the benchmark prompts (HumanEval, MT-Bench, GSM8K). A drafter
can never propose a token outside its vocabulary, so (1 - coverage) bounds the acceptance lost.

Then eagle3 (tree 4,8,32) with the drafter pruned to N in --pruned (no retraining,
`Eagle3Drafter.prune_vocab`) against the unpruned drafter (--drafter, default the shipped one),
prompts interleaved: Mat and tokens/s (greedy output must stay identical).

--export N writes the drafter pruned to the top N tokens to --export-dir (default: the shipped
drafter of --model, fp16 like the export of `train_model.py export-eagle3`): lm_head keeps N rows,
d2t/t2d describe them, config.json says draft_vocab_size N. The ranking depends on the target only,
so exporting from an already pruned drafter with the same N gives the same drafter again.

    python -m benchmarks.draft_vocab [--model moespec-tiny|moespec-base] [--windows 64] [--prompts 8] [--tokens 64] [--pruned 1024,512]
        [--drafter DIR] [--export N [--export-dir DIR]] [--out PATH]
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

import torch

from trtllm_moespec import LLM, SamplingParams, TreeConfig
from trtllm_moespec.assets import SHIPPED_MODELS, shipped_model_paths
from trtllm_moespec.bench.datasets import load_prompts
from trtllm_moespec.training.corpus import read_documents, split_by_file, stdlib_root

SIZES = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def export_pruned(llm: LLM, ranking: torch.Tensor, size: int, source: Path, out_dir: Path) -> Path:
    """The drafter at `source` pruned to the `size` top-ranked tokens, written to out_dir in fp16
    (SpecForge layout) and loaded back on the target as a check."""
    import shutil
    import tempfile

    from trtllm_moespec.models.eagle3 import load_eagle3
    from trtllm_moespec.training.train_eagle3 import save_drafter

    drafter = load_eagle3(source, target=llm.target).prune_vocab(ranking[:size])
    if drafter.config.draft_vocab_size != size:
        raise SystemExit(f"{source} has only {drafter.config.draft_vocab_size} of the top {size} tokens: export "
                         "from a drafter with the full vocabulary")
    with tempfile.TemporaryDirectory() as tmp:  # source may be out_dir: write aside, then replace
        save_drafter(drafter, Path(tmp) / "eagle3")
        load_eagle3(Path(tmp) / "eagle3", target=llm.target)
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.copytree(Path(tmp) / "eagle3", out_dir)
    return out_dir


def _argmax_tokens(llm: LLM, texts: list[str], num_windows: int, window: int, seed: int) -> torch.Tensor:
    """Target argmax at every position of `num_windows` random windows of the tokenized texts."""
    ids = [t for text in texts for t in llm.encode([text])[0]]
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(ids) - window) for _ in range(num_windows)]
    out = []
    for i in range(0, num_windows, 8):
        batch = torch.tensor([ids[s:s + window] for s in starts[i:i + 8]])
        out.append(llm.target.forward_windows(batch).logits.argmax(-1).reshape(-1))
    return torch.cat(out)


def _pruned_eagle3(model: str, ranking: torch.Tensor, sizes: list[int], num_prompts: int, tokens: int, drafter: Path) -> list[dict]:
    """eagle3 with the drafter at `drafter` as it is and pruned to each size, prompts interleaved."""
    import statistics

    llms = {V: LLM(model, policy="eagle3", tree=TreeConfig(4, 8, 32), draft_model=str(drafter))
            for V in [0] + sizes}
    for n, llm in llms.items():
        if n:
            llm.engine.draft_source.drafter.prune_vocab(ranking[:n])
    prompts = [p.text for d in ("humaneval", "mt_bench", "gsm8k") for p in load_prompts(d, num_prompts)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for llm in llms.values():
        llm.generate([prompts[0]], SamplingParams(max_tokens=8, ignore_eos=True))
    stats = {n: [] for n in llms}
    for prompt in prompts:
        outs = {n: llm.generate([prompt], params)[0] for n, llm in llms.items()}
        for n, out in outs.items():
            if out.token_ids != outs[0].token_ids:
                raise SystemExit(f"pruned vocabulary {n} changed the greedy output: not lossless")
            stats[n].append(out.stats)
    rows = []
    for n, st in stats.items():
        rows.append(dict(draft_vocab_size=n or llms[0].engine.draft_source.drafter.config.draft_vocab_size, mean_accepted_tokens=statistics.mean(s.mean_accepted_tokens for s in st),
                         tokens_per_s=statistics.mean(s.tokens_per_s for s in st), draft_ms=statistics.mean(s.draft_ms for s in st)))
    for r in rows:
        r["speedup_vs_full"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moespec-tiny", choices=SHIPPED_MODELS, help="the shipped model family")
    ap.add_argument("--windows", type=int, default=64, help="calibration and held-out windows of 256 tokens")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per dataset for the greedy-output coverage")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pruned", default="1024,512", help="pruned draft-vocabulary sizes to run eagle3 with")
    ap.add_argument("--spec-prompts", type=int, default=3, help="prompts per dataset for the eagle3 runs")
    ap.add_argument("--drafter", type=Path, default=None, help="the unpruned EAGLE-3 drafter directory (default: the model's)")
    ap.add_argument("--export", type=int, default=None, metavar="N", help="write the drafter pruned to N tokens")
    ap.add_argument("--export-dir", type=Path, default=None, help="default: the model's shipped drafter directory")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    shipped_drafter = shipped_model_paths(args.model)["draft"]
    args.drafter, args.export_dir = args.drafter or shipped_drafter, args.export_dir or shipped_drafter
    if args.export is not None and not 1 <= args.export <= 4096:
        raise SystemExit(f"--export N must be in [1, 4096], got {args.export}")
    torch.set_num_threads(1)
    llm = LLM(args.model, policy="ar")
    V = llm.target.vocab_size
    split = split_by_file(stdlib_root())
    calib_files = random.Random(1).sample(list(split.train), 200)
    calib = _argmax_tokens(llm, read_documents(split.root, calib_files), args.windows, 256, seed=0)
    heldout = _argmax_tokens(llm, read_documents(split.root, split.heldout), args.windows, 256, seed=1)
    counts = torch.bincount(calib, minlength=V)
    ranking = torch.argsort(-counts.double() - torch.arange(V) * 1e-9)  # most frequent first, ties by id

    greedy = []
    for dataset in ("humaneval", "mt_bench", "gsm8k"):
        for prompt in load_prompts(dataset, args.prompts):
            out = llm.generate([prompt.text], SamplingParams(max_tokens=args.tokens, ignore_eos=True))[0]
            greedy.extend(out.token_ids)
    greedy_t = torch.tensor(greedy)

    rows = []
    for n in SIZES:
        keep = torch.zeros(V, dtype=torch.bool)
        keep[ranking[:n]] = True
        rows.append(dict(draft_vocab_size=n, heldout_argmax_coverage=float(keep[heldout].float().mean()),
                         greedy_output_coverage=float(keep[greedy_t].float().mean())))
    spec = _pruned_eagle3(args.model, ranking, [int(n) for n in args.pruned.split(",") if n], args.spec_prompts, args.tokens,
                          args.drafter)
    result = dict(benchmark="draft_vocab_coverage", eagle3_pruned=spec, model=args.model, calibration_tokens=int(calib.numel()),
                  heldout_tokens=int(heldout.numel()), greedy_tokens=len(greedy), rows=rows,
                  load_average=os.getloadavg()[0])
    print(f"reduced draft vocabulary coverage (calibration: target argmax on {calib.numel()} corpus tokens)")
    print(f"{'N':>6} {'held-out argmax':>16} {'greedy output':>14}")
    for r in rows:
        print(f"{r['draft_vocab_size']:>6} {100 * r['heldout_argmax_coverage']:>15.1f}% {100 * r['greedy_output_coverage']:>13.1f}%")
    for r in spec:
        print(f"  eagle3 draft vocab {r['draft_vocab_size']:>5}: Mat {r['mean_accepted_tokens']:.2f}, "
              f"{r['tokens_per_s']:.1f} tok/s ({r['speedup_vs_full']:.2f}x full), draft {r['draft_ms']:.2f} ms/step")
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.export is not None:
        print(f"pruned drafter ({args.export} tokens) written to",
              export_pruned(llm, ranking, args.export, args.drafter, args.export_dir))
    return result


if __name__ == "__main__":
    main()
