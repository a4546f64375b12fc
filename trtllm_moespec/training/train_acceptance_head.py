"""Training of the learned acceptance head (`models/acceptance_head.py`) from replay records.

Examples are the valid drafted nodes whose parent the target accepts, of every recorded step
(`moespec replay record`, which stores the drafter's node features and the target's verdict on
every node from a peek forward): features exactly as at inference, label = the target's local
acceptance of the node given its path (argmax match at T=0). Objective: binary cross-entropy; time-bounded,
the head of least validation loss kept (early stop).
Evaluation: held-out loss, and the ranking report (accepted nodes held by the top-k by value).

    python -m trtllm_moespec.training.train_acceptance_head --train runs/replay/train_t0.safetensors \\
        [--val runs/replay/val_t0.safetensors] --heldout runs/replay/heldout_t0.safetensors \\
        --out runs/acceptance_head --minutes 4 [--export trtllm_moespec/assets/moespec-tiny/acceptance-head]

(moespec-base's: `bash build_scripts/make_base.sh acceptance-head`.)
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..models.acceptance_head import (
    AcceptanceHead, AcceptanceHeadConfig, AcceptanceHeadModel, load_head_values, node_scalars, sibling_rank,
)
from ..core.node_features import ContextFollowers
from ..core.values import MIN_COND
from ..replay.records import ReplayFile
from ..replay.score import true_values


@dataclass(frozen=True)
class HeadExamples:
    hidden: torch.Tensor  # [M, H] float16 proposing drafter hidden
    token_ids: torch.Tensor  # [M] int64
    depth: torch.Tensor  # [M] int64
    rank: torch.Tensor  # [M] int64 sibling rank by q
    scalars: torch.Tensor  # [M, S] float32
    label: torch.Tensor  # [M] float32 target local acceptance

    def __len__(self) -> int:
        return self.token_ids.shape[0]


def collect(records: ReplayFile, temperature: float = 0.0) -> HeadExamples:
    """Every valid node under an accepted parent, of every step at `temperature` (needs records made with
    node features)."""
    parts, followers = [], ContextFollowers()  # a request's steps come in order: the index grows with them
    for s in range(records.num_steps):
        step = records.step(s)
        if step.temperature != temperature:
            continue
        if step.node_hidden is None:
            raise ValueError("these records have no node features (recorded with --no-hidden)")
        # a trial of c(v) = P(target accepts v | its parent accepted), as the calibrator's fit counts them
        # (replay fit-calibrator): under a rejected parent the target's pick says nothing a live step sees
        parent = step.tree.parents[0]
        reach = true_values(step)[0]
        v = step.tree.valid[0] & (torch.where(parent >= 0, reach[parent.clamp(min=0)], 1.0) > MIN_COND)
        parts.append((step.node_hidden[0][v].half(), step.tree.token_ids[0][v], step.tree.depth[0][v],
                      torch.from_numpy(sibling_rank(step.tree))[v],
                      torch.from_numpy(node_scalars(step.tree, list(step.context), followers))[v], step.target_local[0][v].float()))
    if not parts:
        raise ValueError(f"no recorded steps at temperature {temperature}")
    return HeadExamples(*(torch.cat(x) for x in zip(*parts)))


def _logits(model: AcceptanceHeadModel, embed: torch.nn.Embedding, ex: HeadExamples, rows: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        emb = embed(ex.token_ids[rows])
    return model(ex.hidden[rows].float(), model.token_part(emb), ex.depth[rows], ex.rank[rows], ex.scalars[rows])


@torch.no_grad()
def heldout_loss(model, embed, ex: HeadExamples) -> float:
    model.eval()
    total = sum(F.binary_cross_entropy_with_logits(_logits(model, embed, ex, r), ex.label[r], reduction="sum").item()
                for r in torch.arange(len(ex)).split(16384))
    model.train()
    return total / len(ex)


def records_model(files: list[ReplayFile], names: list[str]) -> tuple[str, str | None]:
    """The (model, draft model) every file was recorded with: the head reads that drafter's hidden state and
    that target's embedding, so records of two pairs cannot train one head."""
    pairs = {(f.meta["model"], f.meta.get("draft_model")) for f in files}
    if len(pairs) != 1:
        raise ValueError(f"the records {names} were made with different models {sorted(map(str, pairs))}; "
                         "a head is trained on one target/drafter pair")
    return pairs.pop()


def _concat(parts: list[HeadExamples]) -> HeadExamples:
    return HeadExamples(*(torch.cat(x) for x in zip(*[(e.hidden, e.token_ids, e.depth, e.rank, e.scalars, e.label)
                                                      for e in parts])))


def _rows(ex: HeadExamples, idx: torch.Tensor) -> HeadExamples:
    return HeadExamples(ex.hidden[idx], ex.token_ids[idx], ex.depth[idx], ex.rank[idx], ex.scalars[idx], ex.label[idx])


def train(records: list[ReplayFile], out_dir: Path, minutes: float, target, val_records: list[ReplayFile] = (),
          seed: int = 0, intermediate: int = 256, batch_size: int = 2048, lr: float = 2e-3, eval_every: int = 100,
          patience: int = 8, max_steps: int | None = None) -> tuple[AcceptanceHead, dict]:
    """Train a head on the T=0 nodes of `records` for at most `minutes` (and at most `max_steps` steps, whose
    count then paces the learning-rate schedule instead of the clock, so a run does not depend on the
    machine's speed); saved (float32) under out_dir/head.

    The head kept is the one of least validation loss, checked every `eval_every` steps; training stops
    after `patience` checks without a better one. Validation: `val_records` (records of other prompts: a
    few thousand steps overfit within minutes, and nodes of the training steps share their hidden states
    with the examples), else a random 5% of the nodes."""
    torch.manual_seed(seed)
    ex = _concat([collect(r) for r in records])
    if val_records:
        tr, val = ex, _concat([collect(r) for r in val_records])
    else:
        perm = torch.randperm(len(ex), generator=torch.Generator().manual_seed(seed))
        n_val = max(len(ex) // 20, 1)
        val, tr = _rows(ex, perm[:n_val]), _rows(ex, perm[n_val:])
    embed = target.input_embeddings()
    cfg = AcceptanceHeadConfig(hidden_size=tr.hidden.shape[1], embed_size=embed.weight.shape[1],
                               vocab_size=embed.weight.shape[0], intermediate_size=intermediate)
    model = AcceptanceHeadModel(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    best = (heldout_loss(model, embed, val), 0, copy.deepcopy(model.state_dict()))
    t0, step, planned, stale = time.time(), 0, minutes * 60, 0
    while time.time() - t0 < planned and stale < patience and (max_steps is None or step < max_steps):
        frac = step / max_steps if max_steps else (time.time() - t0) / planned
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 20) * (0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * frac)))
        rows = torch.randint(0, len(tr), (batch_size,), generator=gen)
        loss = F.binary_cross_entropy_with_logits(_logits(model, embed, tr, rows), tr.label[rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % eval_every == 0:
            val_bce = heldout_loss(model, embed, val)
            stale = stale + 1 if val_bce >= best[0] else 0
            if val_bce < best[0]:
                best = (val_bce, step, copy.deepcopy(model.state_dict()))
    model.load_state_dict(best[2])
    metrics = {"train_examples": len(tr), "val_examples": len(val), "steps": step, "best_step": best[1],
               "train_s": time.time() - t0, "val_bce": best[0], "label_mean": float(tr.label.mean()),
               "val_label_mean": float(val.label.mean())}
    head = AcceptanceHead(model.eval())
    head.save(out_dir / "head", dtype=torch.float32)
    return head, metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", nargs="+", required=True, help="replay records (T=0, with node features)")
    p.add_argument("--val", nargs="*", default=(), help="records of other prompts for the validation loss that "
                   "picks the head kept (default: a random 5%% of the training nodes)")
    p.add_argument("--heldout", default=None, help="records for the ranking report")
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many steps, pacing the schedule by steps (reproducible across machines)")
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--export", default=None, help="write the fp16 head here (e.g. the moespec-tiny assets)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from ..models.target import TargetModel
    from ..resolve import load_value_model, resolve_model

    records = [ReplayFile.load(f) for f in args.train]
    val_records = [ReplayFile.load(f) for f in args.val]
    paths = resolve_model(*records_model(records + val_records, args.train + list(args.val)))
    target = TargetModel.load(paths.target)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head, metrics = train(records, out, args.minutes, target, val_records, intermediate=args.intermediate,
                          max_steps=args.max_steps)
    metrics["train_files"], metrics["val_files"] = args.train, list(args.val)
    if args.heldout:
        from ..replay.score import ranking

        values = {"raw": load_value_model("raw", paths), "calibrated": load_value_model("calibrated", paths),
                  "head": load_head_values(out / "head", target)}
        metrics["heldout_ranking"] = ranking(ReplayFile.load(args.heldout), values, (1, 2, 4, 8, 16), 32)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if args.export:
        AcceptanceHead.load(out / "head").save(args.export, dtype=torch.float16)
        AcceptanceHead.load(args.export)
    print(json.dumps(metrics, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
