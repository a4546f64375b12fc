"""Training of EcoSpec's standalone expert predictor on the target's routing traces.

Traces: the (shipped, fp16-stored) target runs over windows of the training
stream and of the held-out stream; forward hooks on its routers record the top-K
experts of every token and layer (``routing.RouterTrace``). Objective (EcoSpec
§4.1): layer-wise cross-entropy against the uniform distribution over the
target's top-K experts, i.e. -(1/K) sum_{e in E_gt(t, l)} log p_hat(t, l, e),
averaged over tokens and layers. Metric (App. 8.1): top-K overlap accuracy,
mean |pred ∩ true| / K over tokens and layers of the held-out split.
Time-bounded (cosine over the planned time) and resumable like the target run.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

from trtllm_moespec.models.predictor import ExpertPredictor, PredictorConfig, PredictorModel, causal_mask, topk_overlap
from trtllm_moespec.training.checkpoint import Progress, load_checkpoint, save_checkpoint
from trtllm_moespec.training.data import contiguous_windows, load_streams, random_windows
from trtllm_moespec.training.routing import capture_topk
from trtllm_moespec.training.schedule import cosine_lr


@dataclass(frozen=True)
class PredictorTrainConfig:
    """Knobs of the predictor run."""

    minutes: float = 10.0  # planned training time (traces excluded)
    seq_len: int = 256  # window length of traces and training
    train_windows: int = 1024  # random training windows traced (x seq_len tokens)
    heldout_windows: int = 128  # contiguous held-out windows traced
    batch_size: int = 16
    peak_lr: float = 2e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    eval_every_s: float = 120.0
    seed: int = 0


@dataclass(frozen=True)
class RoutingTraces:
    """Token windows and the target's top-K experts for each of their tokens."""

    input_ids: torch.Tensor  # [W, S] int64
    topk_ids: torch.Tensor  # [W, S, L, K] int64, sorted expert ids


@torch.no_grad()
def collect_traces(target: torch.nn.Module, windows: torch.Tensor, batch_size: int = 8) -> RoutingTraces:
    """Route windows [W, S] through the target and record the experts."""
    target.eval()
    topk = [capture_topk(target, chunk) for chunk in tqdm(windows.split(batch_size), desc="traces", mininterval=10)]
    return RoutingTraces(windows, torch.cat(topk))


def save_traces(traces: RoutingTraces, path: Path) -> None:
    save_file({"input_ids": traces.input_ids.to(torch.int32), "topk_ids": traces.topk_ids.to(torch.uint8)}, str(path))


def load_traces(path: Path) -> RoutingTraces:
    state = load_file(str(path))
    return RoutingTraces(state["input_ids"].long(), state["topk_ids"].long())


def predictor_loss(logits: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Layer-wise CE with a uniform target over the top-K: logits [..., L, E], topk_ids [..., L, K]."""
    return -F.log_softmax(logits.float(), dim=-1).gather(-1, topk_ids).mean()


@torch.no_grad()
def evaluate(predictor: ExpertPredictor, traces: RoutingTraces, batch_size: int = 16) -> tuple[float, float]:
    """(loss, top-K overlap accuracy) of the predictor on ``traces``."""
    model = predictor.model
    was_training = model.training
    model.eval()
    S = traces.input_ids.shape[1]
    positions, mask = torch.arange(S)[None], causal_mask(S)
    losses, accs = [], []
    for ids, true in zip(traces.input_ids.split(batch_size), traces.topk_ids.split(batch_size)):
        logits = model(ids, positions.expand(len(ids), -1), mask.expand(len(ids), -1, -1))
        losses.append(predictor_loss(logits, true).item() * len(ids))
        pred = logits.topk(true.shape[-1], dim=-1).indices
        accs.append(topk_overlap(pred, true) * len(ids))
    model.train(was_training)
    n = traces.input_ids.shape[0]
    return sum(losses) / n, sum(accs) / n


def build_traces(target_dir: Path, data_dir: Path, out_dir: Path, cfg: PredictorTrainConfig) -> tuple[RoutingTraces, RoutingTraces]:
    """Trace the target once; reuse ``out_dir/traces_*.safetensors`` afterwards."""
    paths = out_dir / "traces_train.safetensors", out_dir / "traces_heldout.safetensors"
    if all(p.is_file() for p in paths):
        return load_traces(paths[0]), load_traces(paths[1])
    streams = load_streams(data_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    train_windows = random_windows(streams.train, cfg.train_windows, cfg.seq_len - 1, cfg.seed + 1, 0)
    heldout_windows = contiguous_windows(streams.heldout, cfg.seq_len - 1, cfg.heldout_windows)
    train, heldout = collect_traces(target, train_windows), collect_traces(target, heldout_windows)
    save_traces(train, paths[0])
    save_traces(heldout, paths[1])
    return train, heldout


def _predictor_config(target_config, cfg: PredictorTrainConfig) -> PredictorConfig:
    return PredictorConfig(
        vocab_size=target_config.vocab_size,
        max_seq_len=cfg.seq_len,
        target_num_layers=target_config.num_hidden_layers,
        target_num_experts=target_config.num_experts,
        target_topk=target_config.num_experts_per_tok,
    )


def train_predictor(target_dir: Path, data_dir: Path, out_dir: Path, cfg: PredictorTrainConfig, resume: bool) -> tuple[ExpertPredictor, Progress]:
    """Trace the target, then train (or resume) the predictor in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = logging.getLogger("moespec.train_predictor")
    log.setLevel(logging.INFO)
    if not log.handlers:
        handler = logging.FileHandler(out_dir / "train.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
    start = time.time()
    train, heldout = build_traces(target_dir, data_dir, out_dir, cfg)
    log.info(f"traces: {train.input_ids.numel()} train / {heldout.input_ids.numel()} held-out tokens in {time.time() - start:.0f}s")
    torch.manual_seed(cfg.seed)
    model = PredictorModel(_predictor_config(AutoConfig.from_pretrained(target_dir), cfg)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.peak_lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if resume:
        progress = load_checkpoint(out_dir, model, optimizer)
    else:
        progress = Progress(step=0, planned_s=cfg.minutes * 60, tokens_seen=0, elapsed_s=0.0, best_heldout_loss=float("inf"))
        (out_dir / "run_config.json").write_text(json.dumps(asdict(cfg), indent=2))
        (out_dir / "predictor_config.json").write_text(model.cfg.to_json())
    predictor = ExpertPredictor(model)
    step, tokens, elapsed = progress.step, progress.tokens_seen, progress.elapsed_s
    session_start, last_eval = time.time(), time.time()
    S, W = cfg.seq_len, train.input_ids.shape[0]
    positions, mask = torch.arange(S)[None].expand(cfg.batch_size, -1), causal_mask(S).expand(cfg.batch_size, -1, -1)
    bar = tqdm(total=int(progress.planned_s), initial=int(elapsed), desc="predictor (s)", mininterval=10)
    while elapsed < progress.planned_s:
        rows = torch.randint(0, W, (cfg.batch_size,), generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + step))
        model.train()
        loss = predictor_loss(model(train.input_ids[rows], positions, mask), train.topk_ids[rows])
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, elapsed / progress.planned_s, cfg.peak_lr, cfg.warmup_steps, cfg.min_lr_ratio)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step, tokens = step + 1, tokens + rows.numel() * S
        new_elapsed = progress.elapsed_s + time.time() - session_start
        bar.update(int(new_elapsed) - int(elapsed))
        bar.set_postfix(step=step, loss=f"{loss.item():.3f}")
        elapsed = new_elapsed
        if time.time() - last_eval >= cfg.eval_every_s:
            h_loss, h_acc = evaluate(predictor, heldout)
            log.info(f"step {step} train_loss {loss.item():.4f} heldout_loss {h_loss:.4f} heldout_topk_acc {h_acc:.4f} elapsed {elapsed:.0f}s")
            last_eval = time.time()
    bar.close()
    h_loss, h_acc = evaluate(predictor, heldout)
    final = Progress(step, progress.planned_s, tokens, elapsed, h_loss)
    save_checkpoint(out_dir, model, optimizer, final)
    log.info(f"done: step {step} tokens {tokens} heldout_loss {h_loss:.4f} heldout_topk_acc {h_acc:.4f} elapsed {elapsed:.0f}s")
    (out_dir / "final_eval.json").write_text(json.dumps({"heldout_loss": h_loss, "heldout_topk_acc": h_acc, **asdict(final)}, indent=2))
    return predictor, final
