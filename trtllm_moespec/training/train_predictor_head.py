"""Training of our draft-head expert predictor (`models/predictor_head.py`).

Features are produced exactly as at inference, with the trained (frozen) drafter:
on a window, the target gives its capture hidden states and router top-K ids, the
drafter unrolls `steps` TTT steps (`features.ttt_unroll`, which equals chain
drafting). Step k's output at position t is the hidden that proposes x_{t+2} as a
depth-(k+1) node of a tree rooted at committed position t-k; step 0's output at t
has consumed x_{t+1} and is the root feature when x_{t+1} is the root. Labels are
the target's top-K experts of that token at its own position (t+2, resp. t+1).

Objective: EcoSpec's layer-wise cross-entropy against the uniform distribution over
the target's top-K; metric: top-K overlap accuracy |pred ∩ true| / K per depth on
held-out windows. Features are computed once; training is time-bounded.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..models.eagle3 import Eagle3Drafter, load_eagle3
from ..models.predictor import topk_overlap
from ..models.predictor_head import DraftHeadPredictor, HeadPredictorConfig, HeadPredictorModel, head_loss
from ..models.target import TargetModel
from .data import contiguous_windows, load_streams, random_windows
from .features import target_features, ttt_unroll
from .schedule import cosine_lr


@dataclass(frozen=True)
class HeadTrainConfig:
    minutes: float = 6.0  # training time after the features are built
    seq_len: int = 256
    train_windows: int = 384  # random training windows (x seq_len tokens)
    heldout_windows: int = 48  # contiguous held-out windows
    steps: int = 4  # tree depth covered (= the engine's draft steps)
    intermediate_size: int = 512
    batch_size: int = 4096  # examples per optimizer step
    peak_lr: float = 2e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    seed: int = 0


@dataclass(frozen=True)
class HeadExamples:
    """(feature, token, depth) -> target experts, one row per example."""

    hidden: torch.Tensor  # [M, H] float16 proposing (or root) drafter hidden
    token_ids: torch.Tensor  # [M] int64 the node's (root's) token
    depth: torch.Tensor  # [M] int64, 0 = root
    topk_ids: torch.Tensor  # [M, L, K] int64 target router top-K of that token

    def __len__(self) -> int:
        return self.token_ids.shape[0]


@torch.no_grad()
def collect_examples(target: TargetModel, drafter: Eagle3Drafter, windows: torch.Tensor, steps: int,
                     batch_size: int = 8) -> HeadExamples:
    """Examples of every depth 0..steps from windows [W, S]."""
    parts: list[tuple] = []
    for chunk in tqdm(windows.split(batch_size), desc="head features", mininterval=10):
        feats = target_features(target, chunk)
        T = chunk.shape[1] - 1
        outs = ttt_unroll(drafter, feats.hidden[:, :T], chunk[:, 1:].to(target.device), steps)
        experts = feats.expert_ids.cpu()
        parts.append(_rows(outs[0].hidden, chunk[:, 1:], experts[:, 1:], 0))  # root: consumed x_{t+1}
        for k, out in enumerate(outs):  # depth k+1: proposes x_{t+2}, chains start at t-k >= 0
            sl = slice(k, T - 1)
            parts.append(_rows(out.hidden[:, sl], chunk[:, 2:][:, sl], experts[:, 2:][:, sl], k + 1))
    return HeadExamples(*(torch.cat(xs) for xs in zip(*parts)))


def _rows(hidden: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, depth: int) -> tuple:
    H = hidden.shape[-1]
    n = tokens.numel()
    return (hidden.reshape(n, H).to(torch.float16).cpu(), tokens.reshape(n).long(),
            torch.full((n,), depth, dtype=torch.int64), experts.reshape(n, *experts.shape[2:]).long())


def head_config(target: TargetModel, drafter: Eagle3Drafter, cfg: HeadTrainConfig) -> HeadPredictorConfig:
    return HeadPredictorConfig(
        hidden_size=drafter.config.hidden_size, embed_size=target.hidden_size, vocab_size=target.vocab_size,
        target_num_layers=len(target.moe_layers), target_num_experts=target.num_experts,
        target_topk=target.experts_per_token, intermediate_size=cfg.intermediate_size, max_depth=max(cfg.steps, 1))


def _batch_logits(model: HeadPredictorModel, embed: torch.nn.Embedding, ex: HeadExamples, rows: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        embeds = embed(ex.token_ids[rows])
    return model(ex.hidden[rows].float(), embeds, ex.depth[rows])


@torch.no_grad()
def evaluate_head(model: HeadPredictorModel, embed: torch.nn.Embedding, ex: HeadExamples, max_depth: int,
                  batch_size: int = 8192) -> dict:
    """Loss and top-K overlap accuracy overall and per depth (0 = root)."""
    was_training = model.training
    model.eval()
    preds, losses = [], []
    for rows in torch.arange(len(ex)).split(batch_size):
        logits = _batch_logits(model, embed, ex, rows)
        losses.append(head_loss(logits, ex.topk_ids[rows]).item() * len(rows))
        preds.append(logits.topk(ex.topk_ids.shape[-1], dim=-1).indices)
    model.train(was_training)
    pred = torch.cat(preds)
    per_depth = {d: topk_overlap(pred[ex.depth == d], ex.topk_ids[ex.depth == d])
                 for d in range(max_depth + 1) if bool((ex.depth == d).any())}
    nodes = ex.depth > 0
    return {"loss": sum(losses) / len(ex), "acc_nodes": topk_overlap(pred[nodes], ex.topk_ids[nodes]),
            "acc_per_depth": per_depth}


def train_predictor_head(target_dir: Path, drafter_dir: Path, data_dir: Path, out_dir: Path, cfg: HeadTrainConfig,
                         max_steps: int | None = None) -> tuple[DraftHeadPredictor, dict]:
    """Build features with the shipped target + drafter, train the head, save out_dir/head (fp32)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = logging.getLogger(f"moespec.train_predictor_head.{out_dir.resolve()}")
    log.setLevel(logging.INFO)
    if not log.handlers:
        handler = logging.FileHandler(out_dir / "train.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
    start = time.time()
    streams = load_streams(data_dir)
    target = TargetModel.load(target_dir)
    drafter = load_eagle3(drafter_dir, target=target)
    embed = target.input_embeddings()
    train = collect_examples(target, drafter, random_windows(streams.train, cfg.train_windows, cfg.seq_len - 1,
                                                             cfg.seed + 11, 0), cfg.steps)
    heldout = collect_examples(target, drafter, contiguous_windows(streams.heldout, cfg.seq_len - 1,
                                                                   cfg.heldout_windows), cfg.steps)
    log.info(f"features: {len(train)} train / {len(heldout)} held-out examples in {time.time() - start:.0f}s")
    torch.manual_seed(cfg.seed)
    model = HeadPredictorModel(head_config(target, drafter, cfg)).train()
    (out_dir / "run_config.json").write_text(json.dumps({"target": str(target_dir), "drafter": str(drafter_dir),
                                                         "train": asdict(cfg)}, indent=2) + "\n")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.peak_lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, t0, planned = 0, time.time(), cfg.minutes * 60
    bar = tqdm(total=int(planned), desc="head (s)", mininterval=10)
    elapsed = 0.0
    while elapsed < planned and (max_steps is None or step < max_steps):
        rows = torch.randint(0, len(train), (cfg.batch_size,), generator=gen)
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, elapsed / planned, cfg.peak_lr, cfg.warmup_steps, cfg.min_lr_ratio)
        loss = head_loss(_batch_logits(model, embed, train, rows), train.topk_ids[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        new_elapsed = time.time() - t0
        bar.update(int(new_elapsed) - int(elapsed))
        elapsed = new_elapsed
        bar.set_postfix(step=step, loss=f"{loss.item():.3f}")
        if step % 200 == 0:
            log.info(f"step {step} loss {loss.item():.4f} elapsed {elapsed:.0f}s")
    bar.close()
    metrics = evaluate_head(model, embed, heldout, cfg.steps)
    metrics.update(train_loss=loss.item() if step else float("nan"), steps=step, train_s=elapsed,
                   num_train_examples=len(train), num_heldout_examples=len(heldout))
    log.info(f"done: {json.dumps(metrics)}")
    predictor = DraftHeadPredictor(model)
    predictor.save(out_dir / "head", dtype=torch.float32)
    (out_dir / "final_eval.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return predictor, metrics


def export_predictor_head(run_dir: Path, out_dir: Path) -> Path:
    """Copy run_dir/head to the package assets in fp16 and check it loads."""
    import shutil

    predictor = DraftHeadPredictor.load(run_dir / "head")
    shutil.rmtree(out_dir, ignore_errors=True)
    predictor.save(out_dir, dtype=torch.float16)
    DraftHeadPredictor.load(out_dir)
    return out_dir
