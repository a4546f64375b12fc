"""Time-bounded, resumable training of the EAGLE-3 drafter of a (frozen) MoE target.

Recipe (EAGLE-3 with training-time test, see `features.ttt_unroll`): every batch
is a set of random windows of the training stream; the target runs once under
no_grad (`features.target_features`) and gives the three captured hidden states
and its next-token logits. The drafter unrolls `ttt_steps` steps; step k at
position t predicts x_{t+2} and is trained to match the TARGET's distribution
there, softmax(target logits at t+1) (the loss is KL(target || drafter), i.e. the
soft cross-entropy minus the target's entropy, so 0 is a perfect match; EAGLE-3 distils the target's predictions rather than the corpus tokens: at
T = 0 acceptance is decided by the target's argmax, not by the data). Step k's
loss is weighted by `step_decay**k`. Tokens fed along the chains are the corpus
tokens (teacher forcing), hidden states are the drafter's own.

Data: corpus windows of the training split, mixed (`selfgen_fraction`) with
self-distillation windows: a corpus prefix followed by the target's own greedy
continuation (`build_selfgen`), so the chains are also trained on the text the
drafter must predict at T = 0 (the target's greedy output), as EAGLE-3 / SpecForge
regenerate their training responses with the target.

The drafter shares the target's (frozen) input embedding, so the shipped
checkpoint carries no `embed_tokens`; `lm_head` and the final `norm` start from
the target's output head and final norm. The cosine schedule runs over training
wall time like the target run; `--resume` continues it.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from ..models.eagle3 import Eagle3Config, Eagle3Drafter, load_eagle3
from ..models.target import TargetModel
from .checkpoint import Progress, load_checkpoint, save_checkpoint
from .data import contiguous_windows, load_streams, random_windows
from .features import target_features, ttt_unroll, ttt_valid
from .schedule import cosine_lr


@dataclass(frozen=True)
class Eagle3TrainConfig:
    """Shape and optimisation knobs of the drafter run."""

    minutes: float = 25.0  # planned training time (schedule length) / session budget with resume
    seq_len: int = 256  # window length fed to the target (the drafter sees seq_len - 1 positions)
    batch_size: int = 8
    ttt_steps: int = 4  # unrolled draft steps (step 0 = from target features)
    step_decay: float = 0.8  # loss weight of step k: step_decay**k
    intermediate_size: int = 512  # drafter MLP width
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_every_s: float = 240.0
    ckpt_every_s: float = 180.0
    eval_windows: int = 16  # held-out windows of seq_len tokens
    selfgen_sequences: int = 0  # target-generated (greedy) windows for self-distillation; 0 = corpus only (shipped build)
    selfgen_prompt_len: int = 64  # corpus tokens before each greedy continuation
    selfgen_fraction: float = 0.5  # share of each batch drawn from the self-generated windows
    seed: int = 0
    extend_minutes: float = 0.0  # with resume: append a new cosine segment of this length (e.g. on a retrained target)
    extend_peak_lr: float = 1e-3  # its starting lr
    init_from: str = ""  # exported drafter a new run starts from (a later segment on a fresh machine); "" = fresh


@dataclass(frozen=True)
class StepMetrics:
    """Per-TTT-step loss and top-1 agreement with the target's argmax."""

    loss: float  # weighted total
    step_loss: tuple[float, ...]
    step_acc: tuple[float, ...]


def drafter_config(target: TargetModel, cfg: Eagle3TrainConfig) -> Eagle3Config:
    """Drafter of the target's width (so it can share the target's embedding), full vocabulary."""
    tc = target.config
    return Eagle3Config(
        hidden_size=target.hidden_size, intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, vocab_size=target.vocab_size, draft_vocab_size=target.vocab_size,
        target_hidden_size=target.hidden_size, rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        max_position_embeddings=target.max_position_embeddings,
        rope_theta=float(getattr(tc, "rope_theta", None) or (getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
    )


def init_drafter(target: TargetModel, cfg: Eagle3TrainConfig) -> Eagle3Drafter:
    """A fresh drafter on the target's frozen embedding, head and final norm copied from the target."""
    torch.manual_seed(cfg.seed)
    embed = target.input_embeddings()
    embed.weight.requires_grad_(False)
    drafter = Eagle3Drafter(drafter_config(target, cfg), embed_tokens=embed).to(target.dtype)
    for name, p in drafter.named_parameters():
        if name.startswith("embed_tokens."):
            continue
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.normal_(p, std=0.02)
    with torch.no_grad():
        drafter.lm_head.weight.copy_(target.model.get_output_embeddings().weight)
        final_norm = getattr(getattr(target.model, "model", None), "norm", None)
        if final_norm is not None:
            drafter.norm.weight.copy_(final_norm.weight)
    return drafter


def warm_start_drafter(drafter: Eagle3Drafter, exported: Path, target: TargetModel) -> int:
    """Start a new run from an exported drafter (a later training segment: a fresh machine has no
    optimizer state, only the shipped checkpoint). Every weight is copied into the full-vocabulary
    drafter being trained; a pruned draft vocabulary's `lm_head` rows go to its tokens' rows, and the
    other tokens' rows keep the target's output head they started from (`init_drafter`), so pruning
    the export again gives the same vocabulary. Returns the exported draft vocabulary's size."""
    source = load_eagle3(exported, target=target)
    want = drafter.config.to_dict() | {"draft_vocab_size": None}
    have = source.config.to_dict() | {"draft_vocab_size": None}
    if want != have:
        diff = sorted(k for k in want if want[k] != have.get(k))
        raise ValueError(f"the drafter at {exported} does not match this run's shape ({', '.join(diff)} differ): "
                         "a warm start keeps the drafter's shape (Eagle3TrainConfig)")
    shared = {k: v for k, v in source.state_dict().items()
              if not k.startswith("embed_tokens.") and k not in ("lm_head.weight", "d2t", "t2d")}
    drafter.load_state_dict(shared, strict=False)
    with torch.no_grad():
        drafter.lm_head.weight[source.draft_vocab_target_ids()] = source.lm_head.weight
    return source.config.draft_vocab_size


def trainable_parameters(drafter: Eagle3Drafter) -> list[torch.nn.Parameter]:
    return [p for n, p in drafter.named_parameters() if not n.startswith("embed_tokens.")]


def distill_loss(drafter: Eagle3Drafter, target: TargetModel, windows: torch.Tensor, cfg: Eagle3TrainConfig
                 ) -> tuple[torch.Tensor, StepMetrics]:
    """Weighted TTT loss over windows [B, S] (S = seq_len): soft CE against the target's next-token
    distribution at every unrolled step."""
    feats = target_features(target, windows)
    T = windows.shape[1] - 1  # drafter positions 0..S-2: token x_{t+1}, label = target at t+1
    outs = ttt_unroll(drafter, feats.hidden[:, :T], windows[:, 1:].to(target.device), cfg.ttt_steps)
    teacher_logp = torch.log_softmax(feats.logits[:, 1:], dim=-1)  # [B, T, V]
    teacher = teacher_logp.exp()
    teacher_top1 = teacher.argmax(-1)
    total = torch.zeros((), device=teacher.device)
    losses, accs = [], []
    for k, out in enumerate(outs):
        valid = ttt_valid(T, k, teacher.device)
        logq = F.log_softmax(out.logits[:, valid], dim=-1)
        loss_k = (teacher[:, valid] * (teacher_logp[:, valid] - logq)).sum(-1).mean()  # KL(target || draft)
        total = total + cfg.step_decay**k * loss_k
        losses.append(loss_k.item())
        accs.append((out.logits[:, valid].argmax(-1) == teacher_top1[:, valid]).float().mean().item())
    return total, StepMetrics(total.item(), tuple(losses), tuple(accs))


@torch.no_grad()
def evaluate(drafter: Eagle3Drafter, target: TargetModel, windows: torch.Tensor, cfg: Eagle3TrainConfig,
             batch_size: int = 8) -> StepMetrics:
    """Mean TTT metrics over fixed held-out windows [W, S]."""
    was_training = drafter.training
    drafter.eval()
    parts = [distill_loss(drafter, target, chunk, cfg)[1] for chunk in windows.split(batch_size)]
    drafter.train(was_training)
    n = len(parts)
    mean = lambda xs: tuple(sum(v) / n for v in zip(*xs))  # noqa: E731
    return StepMetrics(sum(p.loss for p in parts) / n, mean([p.step_loss for p in parts]),
                       mean([p.step_acc for p in parts]))


@torch.no_grad()
def build_selfgen(target: TargetModel, stream: np.ndarray, cfg: Eagle3TrainConfig, path: Path,
                  batch_size: int = 32) -> np.ndarray:
    """[N, seq_len] uint16 windows: `selfgen_prompt_len` corpus tokens + the target's greedy continuation
    (end-of-text ignored, as in the acceptance runs). Cached at `path`."""
    if path.is_file():
        return np.load(path)
    prompts = random_windows(stream, cfg.selfgen_sequences, cfg.selfgen_prompt_len - 1, cfg.seed + 13, 0)
    new = cfg.seq_len - cfg.selfgen_prompt_len
    if new < 1:
        raise ValueError(f"selfgen_prompt_len {cfg.selfgen_prompt_len} must be shorter than seq_len {cfg.seq_len}")
    rows = [greedy_continue(target.model, chunk.to(target.device), new).cpu().numpy().astype(np.uint16)
            for chunk in tqdm(prompts.split(batch_size), desc="self-distillation data", mininterval=10)]
    windows = np.concatenate(rows)
    np.save(path, windows)
    return windows


@torch.no_grad()
def greedy_continue(model: torch.nn.Module, input_ids: torch.Tensor, num_new: int) -> torch.Tensor:
    """input_ids [B, P] followed by `num_new` argmax tokens (no stop token, no logits processors)."""
    from transformers import DynamicCache

    import inspect

    cache = {("cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"): DynamicCache()}
    logits = model(input_ids=input_ids, use_cache=True, **cache).logits[:, -1]
    out = [input_ids]
    for i in range(num_new):
        nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        if i + 1 < num_new:
            logits = model(input_ids=nxt, use_cache=True, **cache).logits[:, -1]
    return torch.cat(out, dim=1)


def training_batch(corpus: np.ndarray, selfgen: np.ndarray | None, cfg: Eagle3TrainConfig, step: int) -> torch.Tensor:
    """[B, seq_len] windows of step `step`: corpus windows and (a `selfgen_fraction` of) self-generated ones."""
    n_self = 0 if selfgen is None or len(selfgen) == 0 else round(cfg.batch_size * cfg.selfgen_fraction)
    parts = []
    if cfg.batch_size - n_self:
        parts.append(random_windows(corpus, cfg.batch_size - n_self, cfg.seq_len - 1, cfg.seed + 7, step))
    if n_self:
        rows = np.random.default_rng([cfg.seed + 17, step]).integers(0, len(selfgen), n_self)
        parts.append(torch.from_numpy(selfgen[rows].astype(np.int64)))
    return torch.cat(parts)


def _fmt(m: StepMetrics) -> str:
    return (f"loss {m.loss:.4f} step_loss " + " ".join(f"{x:.3f}" for x in m.step_loss)
            + " step_acc " + " ".join(f"{x:.3f}" for x in m.step_acc))


def _logger(out_dir: Path) -> logging.Logger:
    log = logging.getLogger(f"moespec.train_eagle3.{out_dir.resolve()}")
    log.setLevel(logging.INFO)
    if not log.handlers:
        handler = logging.FileHandler(out_dir / "train.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
    return log


def train_eagle3(target_dir: Path, data_dir: Path, out_dir: Path, cfg: Eagle3TrainConfig, resume: bool,
                 max_steps: int | None = None) -> tuple[Eagle3Drafter, Progress]:
    """Train (or resume) the drafter of the target at target_dir in out_dir; returns it and its progress.

    Stops at the planned time, at the session's `cfg.minutes`, or after `max_steps` optimizer steps.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    log = _logger(out_dir)
    streams = load_streams(data_dir)
    target = TargetModel.load(target_dir)
    drafter = init_drafter(target, cfg).train()
    optimizer = torch.optim.AdamW(trainable_parameters(drafter), lr=cfg.peak_lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay)
    heldout = contiguous_windows(streams.heldout, cfg.seq_len - 1, cfg.eval_windows)
    if resume:
        progress = load_checkpoint(out_dir, drafter, optimizer)
        if cfg.extend_minutes > 0:
            progress = replace(progress, segment_start_s=progress.elapsed_s, segment_peak_lr=cfg.extend_peak_lr,
                               planned_s=progress.elapsed_s + cfg.extend_minutes * 60)
        log.info(f"resumed at step {progress.step}, {progress.elapsed_s:.0f}/{progress.planned_s:.0f}s, target {target_dir}")
    else:
        progress = Progress(step=0, planned_s=cfg.minutes * 60, tokens_seen=0, elapsed_s=0.0, best_heldout_loss=float("inf"))
        if cfg.init_from:
            vocab = warm_start_drafter(drafter, Path(cfg.init_from), target)
            log.info(f"warm start from {cfg.init_from} (draft vocabulary {vocab}): held-out "
                     f"{_fmt(evaluate(drafter, target, heldout, cfg))}")
        (out_dir / "run_config.json").write_text(json.dumps({"target": str(target_dir), "train": asdict(cfg),
                                                             "drafter": drafter.config.to_dict()}, indent=2) + "\n")
        n = sum(p.numel() for p in trainable_parameters(drafter))
        log.info(f"start: {n} trainable drafter params, target {target_dir}, train {asdict(cfg)}")
    selfgen = None
    if cfg.selfgen_sequences > 0:
        t0 = time.time()
        selfgen = build_selfgen(target, streams.train, cfg, out_dir / "selfgen.npy")
        log.info(f"self-distillation windows: {selfgen.shape} ({time.time() - t0:.0f}s)")
    step, tokens, best = progress.step, progress.tokens_seen, progress.best_heldout_loss
    session_start = last_eval = last_ckpt = time.time()
    deadline = session_start + cfg.minutes * 60
    elapsed = progress.elapsed_s
    bar = tqdm(total=int(progress.planned_s), initial=int(elapsed), desc="eagle3 (s)", mininterval=10)
    while elapsed < progress.planned_s and time.time() < deadline and (max_steps is None or step < max_steps):
        windows = training_batch(streams.train, selfgen, cfg, step)
        segment = max(progress.planned_s - progress.segment_start_s, 1e-9)  # the whole run, or an appended segment
        lr = cosine_lr(step, (elapsed - progress.segment_start_s) / segment, progress.segment_peak_lr or cfg.peak_lr,
                       cfg.warmup_steps, cfg.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, metrics = distill_loss(drafter, target, windows, cfg)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable_parameters(drafter), cfg.grad_clip)
        optimizer.step()
        step, tokens = step + 1, tokens + windows.shape[0] * (windows.shape[1] - 1)
        new_elapsed = progress.elapsed_s + time.time() - session_start
        bar.update(int(new_elapsed) - int(elapsed))
        elapsed = new_elapsed
        bar.set_postfix(step=step, loss=f"{metrics.loss:.3f}", acc0=f"{metrics.step_acc[0]:.3f}")
        if step % 10 == 0 or step == 1:
            log.info(f"step {step} lr {lr:.2e} {_fmt(metrics)} tokens {tokens} elapsed {elapsed:.0f}/{progress.planned_s:.0f}s "
                     f"({tokens / max(elapsed, 1e-9):.0f} tok/s)")
        now = time.time()
        if now - last_eval >= cfg.eval_every_s:
            m = evaluate(drafter, target, heldout, cfg)
            best = min(best, m.loss)
            log.info(f"eval step {step} heldout {_fmt(m)}")
            last_eval = time.time()
        if now - last_ckpt >= cfg.ckpt_every_s:
            save_checkpoint(out_dir, drafter, optimizer, replace(progress, step=step, tokens_seen=tokens,
                                                                 elapsed_s=elapsed, best_heldout_loss=best))
            last_ckpt = time.time()
    bar.close()
    m = evaluate(drafter, target, heldout, cfg)
    best = min(best, m.loss)
    final = replace(progress, step=step, tokens_seen=tokens, elapsed_s=elapsed, best_heldout_loss=best)
    save_checkpoint(out_dir, drafter, optimizer, final)
    log.info(f"done: step {step} tokens {tokens} elapsed {elapsed:.0f}s heldout {_fmt(m)}")
    (out_dir / "final_eval.json").write_text(json.dumps({"heldout": asdict(m), **asdict(final)}, indent=2) + "\n")
    return drafter, final


def save_drafter(drafter: Eagle3Drafter, out_dir: Path, dtype: torch.dtype = torch.float16,
                 with_embeddings: bool = False) -> Path:
    """Write drafter in the SpecForge/SGLang format: config.json + model.safetensors (d2t, t2d included)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in drafter.state_dict().items():
        if name.startswith("embed_tokens.") and not with_embeddings:
            continue
        tensors[name] = t.detach().to(dtype).contiguous() if t.is_floating_point() else t.detach().contiguous()
    (out_dir / "config.json").write_text(json.dumps(drafter.config.to_dict(), indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def export_eagle3(run_dir: Path, target_dir: Path, out_dir: Path, dtype: torch.dtype = torch.float16) -> Path:
    """Export run_dir/ckpt to out_dir (without the shared embedding) and check it loads on the target."""
    from safetensors.torch import load_file

    run = json.loads((run_dir / "run_config.json").read_text())
    target = TargetModel.load(target_dir)
    drafter = Eagle3Drafter(Eagle3Config.from_dict(run["drafter"]), embed_tokens=target.input_embeddings())
    state = load_file(str(run_dir / "ckpt" / "model.safetensors"))
    missing, unexpected = drafter.load_state_dict(
        {k: v for k, v in state.items() if not k.startswith("embed_tokens.")}, strict=False)
    if unexpected or [m for m in missing if not m.startswith("embed_tokens.")]:
        raise ValueError(f"{run_dir / 'ckpt'} does not match its run_config: missing {missing}, unexpected {unexpected}")
    shutil.rmtree(out_dir, ignore_errors=True)
    save_drafter(drafter, out_dir, dtype)
    load_eagle3(out_dir, target=target)
    return out_dir
