"""Time-bounded, resumable training of the tiny Qwen3-MoE target.

The loss is next-token cross-entropy plus ``router_aux_loss_coef`` times the
Switch load-balancing loss of each MoE layer, averaged over the layers
(`layer_balance_loss`). transformers' own ``aux_loss`` pools every layer's routing
before it measures the balance, so experts that share an index in different layers
count as one: it reads balanced (top-k) while single layers route most tokens to a few
experts (moespec-base's fresh layers did, under it). The cosine schedule runs over
training wall time (``planned_s`` = ``--minutes`` of the first launch, stored in
the checkpoint), not over a step count: the machine is shared and its throughput
varies several-fold, so a step count calibrated at launch would end the run far
too early or too late. ``--resume`` continues the same schedule where it stopped;
``--resume --extend-minutes M`` appends a new cosine segment of M minutes that
starts at ``extend_peak_lr`` (no warmup), to keep training a finished run.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import Qwen3MoeForCausalLM

from trtllm_moespec.training.checkpoint import Progress, load_checkpoint, save_checkpoint
from trtllm_moespec.training.data import contiguous_windows, load_streams, random_windows
from trtllm_moespec.training.schedule import cosine_lr
from trtllm_moespec.training.target import TargetShape, make_config
from trtllm_moespec.training.upscale import warm_start


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation knobs of the target run."""

    minutes: float = 60.0  # wall-clock budget of this session
    seq_len: int = 512  # training context
    batch_size: int = 8  # sequences per step (8 x 512 = 4k tokens)
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine floor
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    extend_minutes: float = 0.0  # with resume: length of a new cosine segment
    extend_peak_lr: float = 1e-3  # its starting lr
    eval_every_s: float = 300.0
    ckpt_every_s: float = 300.0
    eval_windows: int = 16  # held-out windows per periodic evaluation
    final_eval_windows: int = 96  # at the end of a session (the export reports the full held-out set)
    seed: int = 0
    init_from: str = ""  # exported target to warm-start a new run from (training/upscale.py); "" = random init
    # Decoder layers whose weights train; the rest of the model (other layers, embedding, final norm) stays
    # frozen. () = everything trains. Up-scaled layers that start as identities learn little while the layers
    # they were inserted between can absorb the gradient (block expansion: LLaMA-Pro trains the new blocks only).
    train_layers: tuple[int, ...] = ()


def lr_at(step: int, elapsed_s: float, progress: Progress, cfg: TrainConfig) -> float:
    """Linear warmup over steps, then cosine over the elapsed fraction of the current segment."""
    length = max(progress.planned_s - progress.segment_start_s, 1e-9)
    frac = (elapsed_s - progress.segment_start_s) / length
    return cosine_lr(step, frac, progress.segment_peak_lr or cfg.peak_lr, cfg.warmup_steps, cfg.min_lr_ratio)


def freeze_all_but(model: Qwen3MoeForCausalLM, layers: tuple[int, ...]) -> None:
    """Only the decoder layers `layers` keep requires_grad (no-op for an empty tuple)."""
    if not layers:
        return
    num_layers = model.config.num_hidden_layers
    bad = [l for l in layers if not 0 <= l < num_layers]
    if bad:
        raise ValueError(f"train_layers {bad} outside the model's {num_layers} layers")
    keep = {f"model.layers.{l}." for l in layers}
    for name, p in model.named_parameters():
        p.requires_grad_(any(name.startswith(k) for k in keep))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=(0.9, 0.95), eps=1e-8)


def layer_balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Mean over MoE layers of each layer's Switch balancing loss, E * sum_e f_e * P_e, with f_e the share
    of the layer's top-k slots routed to expert e and P_e its mean router probability; router_logits: one
    [tokens, E] per layer. Balanced routing gives top_k in every layer."""
    losses = []
    for logits in router_logits:
        probs = logits.float().softmax(-1)  # [T, E]
        E = probs.shape[-1]
        chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, E).float()  # [T, k, E]
        losses.append(E * (chosen.mean(0) * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def trained_routers(router_logits: tuple[torch.Tensor, ...], train_layers: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The router logits the balancing loss covers: those of the layers that train (all when ``train_layers`` is
    empty). A frozen layer's router cannot move, and counting it in the mean only dilutes the weight of those that
    can. Every decoder layer is an MoE layer in our families, so router_logits[l] is layer l's."""
    return tuple(router_logits[l] for l in train_layers) if train_layers else router_logits


def train_step(model: Qwen3MoeForCausalLM, optimizer: torch.optim.Optimizer, batch: torch.Tensor, lr: float, cfg: TrainConfig) -> tuple[float, float]:
    """One optimizer step on ``batch`` [B, S + 1]; returns (lm loss, aux loss)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    out = model(input_ids=batch[:, :-1], output_router_logits=True, use_cache=False)
    lm_loss = F.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten())
    aux = layer_balance_loss(trained_routers(out.router_logits, cfg.train_layers), model.config.num_experts_per_tok)
    loss = lm_loss + model.config.router_aux_loss_coef * aux
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    return lm_loss.item(), aux.item()


@torch.no_grad()
def heldout_loss(model: Qwen3MoeForCausalLM, stream: np.ndarray, seq_len: int, max_windows: int | None, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats/token) over contiguous held-out windows."""
    was_training = model.training
    model.eval()
    windows = contiguous_windows(stream, seq_len, max_windows)
    total, count = 0.0, 0
    for chunk in windows.split(batch_size):
        logits = model(input_ids=chunk[:, :-1], use_cache=False).logits
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    model.train(was_training)
    return total / count


def _progress(start: Progress, step: int, planned: float, tokens: int, session_start: float, best: float) -> Progress:
    elapsed = start.elapsed_s + time.time() - session_start
    return replace(start, step=step, planned_s=planned, tokens_seen=tokens, elapsed_s=elapsed, best_heldout_loss=best)


def _setup_logging(out_dir: Path) -> logging.Logger:
    logger = logging.getLogger("moespec.train_target")
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        handler = logging.FileHandler(out_dir / "train.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(handler)
    return logger


def train_target(data_dir: Path, out_dir: Path, shape: TargetShape, cfg: TrainConfig, resume: bool) -> Progress:
    """Train (or resume) the target in ``out_dir``; returns the final progress."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = _setup_logging(out_dir)
    streams = load_streams(data_dir)
    torch.manual_seed(cfg.seed)
    model = Qwen3MoeForCausalLM(make_config(shape)).train()
    freeze_all_but(model, cfg.train_layers)
    optimizer = make_optimizer(model, cfg)
    if resume:
        progress = load_checkpoint(out_dir, model, optimizer)
        if cfg.extend_minutes > 0:
            progress = replace(progress, segment_start_s=progress.elapsed_s, planned_s=progress.elapsed_s + cfg.extend_minutes * 60, segment_peak_lr=cfg.extend_peak_lr)
        log.info(f"resumed at step {progress.step}, {progress.elapsed_s:.0f}/{progress.planned_s:.0f}s")
    else:
        progress = Progress(step=0, planned_s=cfg.minutes * 60, tokens_seen=0, elapsed_s=0.0, best_heldout_loss=float("inf"))
        if cfg.init_from:
            how = warm_start(model, Path(cfg.init_from))
            log.info(f"warm start ({how}) from {cfg.init_from}: held-out loss {heldout_loss(model, streams.heldout, cfg.seq_len, cfg.eval_windows):.4f}")
        (out_dir / "run_config.json").write_text(json.dumps({"shape": asdict(shape), "train": asdict(cfg)}, indent=2))
        log.info(f"start: {sum(p.numel() for p in model.parameters())} params, shape {asdict(shape)}, train {asdict(cfg)}")
    step, tokens, best = progress.step, progress.tokens_seen, progress.best_heldout_loss
    planned = progress.planned_s
    session_start = time.time()
    last_eval = last_ckpt = session_start
    deadline = session_start + cfg.minutes * 60
    bar = tqdm(total=int(planned), initial=int(progress.elapsed_s), desc="target (s)", mininterval=10)
    elapsed = progress.elapsed_s
    while elapsed < planned and time.time() < deadline:
        batch = random_windows(streams.train, cfg.batch_size, cfg.seq_len, cfg.seed, step)
        lr = lr_at(step, elapsed, progress, cfg)
        lm_loss, aux = train_step(model, optimizer, batch, lr, cfg)
        step, tokens = step + 1, tokens + batch[:, 1:].numel()
        new_elapsed = progress.elapsed_s + time.time() - session_start
        bar.update(int(new_elapsed) - int(elapsed))
        elapsed = new_elapsed
        bar.set_postfix(step=step, loss=f"{lm_loss:.3f}", aux=f"{aux:.3f}")
        if step % 10 == 0:
            rate = tokens / max(elapsed, 1e-9)
            log.info(f"step {step} loss {lm_loss:.4f} aux {aux:.4f} lr {lr:.2e} tokens {tokens} elapsed {elapsed:.0f}/{planned:.0f}s ({rate:.0f} tok/s avg)")
        now = time.time()
        if now - last_eval >= cfg.eval_every_s:
            loss = heldout_loss(model, streams.heldout, cfg.seq_len, cfg.eval_windows)
            best = min(best, loss)
            log.info(f"eval step {step} heldout_loss {loss:.4f} ppl {math.exp(loss):.2f}")
            last_eval = time.time()
        if now - last_ckpt >= cfg.ckpt_every_s:
            save_checkpoint(out_dir, model, optimizer, _progress(progress, step, planned, tokens, session_start, best))
            last_ckpt = time.time()
    bar.close()
    loss = heldout_loss(model, streams.heldout, cfg.seq_len, cfg.final_eval_windows)
    best = min(best, loss)
    final = _progress(progress, step, planned, tokens, session_start, best)
    save_checkpoint(out_dir, model, optimizer, final)
    log.info(f"done: step {step} tokens {tokens} heldout_loss {loss:.4f} ppl {math.exp(loss):.2f} elapsed {final.elapsed_s:.0f}s")
    (out_dir / "final_eval.json").write_text(json.dumps({"heldout_loss": loss, "ppl": math.exp(loss), **asdict(final)}, indent=2))
    return final
