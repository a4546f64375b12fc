"""A learned acceptance head: P(target accepts node v | v's parent accepted), from the drafter.

The drafter is distilled to track the target's *distribution*; greedy acceptance needs an
*argmax* match, and on repetitive text the target's continuation is often a copy of what
came before. This head re-scores each drafted node from what the drafter already has, with
no extra forward:

  - the pre-norm drafter hidden of the forward that proposed v (`Eagle3Draft.node_hidden`,
    shared by siblings; it summarises the context and v's path up to its parent),
  - the embedding of v's token (the target's, shared with the drafter),
  - v's depth and its rank among its siblings (by q),
  - log q(v) and the log raw path score,
  - copy features: does v's token follow the last n tokens of (context + path) somewhere in
    the context (n = 1, 2, 4), and is it the *most recent* such follower (loops repeat).

Output: a logit per node; sigmoid = the local acceptance probability. Composed along the
path (and corrected online per request by the per-depth isotonic calibrator of core/values.py)
it is the node value. Trained with binary cross-entropy on recorded target verdicts
(`moespec replay record`; training/train_acceptance_head.py).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..core.device import to_device
from ..core.followers_host import copy_flags_of
from ..core.node_features import NGRAM_ORDERS, ContextFollowers, copy_features, sibling_rank
from ..core.tree import DraftTree
from .acceptance_head_host import HostHeadWeights, compiled_head

__all__ = ["AcceptanceHead", "AcceptanceHeadConfig", "AcceptanceHeadModel", "copy_features", "load_head_values",
           "node_scalars", "sibling_rank", "write_random_acceptance_head"]
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
HEAD_TYPE = "acceptance_head"
NUM_SCALARS = 2 + 2 * len(NGRAM_ORDERS)  # log q, log score, (any, most recent) per n-gram order


@dataclass(frozen=True)
class AcceptanceHeadConfig:
    hidden_size: int  # drafter hidden width H
    embed_size: int  # token embedding width (the target's)
    vocab_size: int  # target vocabulary (for checking)
    intermediate_size: int = 256
    max_depth: int = 8  # deeper nodes share the last depth bias
    max_rank: int = 16  # sibling ranks beyond share the last bias
    rms_norm_eps: float = 1e-6

    def to_json(self) -> str:
        return json.dumps({"head_type": HEAD_TYPE, **asdict(self)}, indent=2) + "\n"

    @staticmethod
    def from_json(text: str, source: str) -> "AcceptanceHeadConfig":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source} is not valid JSON: {err}") from None
        if raw.get("head_type") != HEAD_TYPE:
            raise ValueError(f"{source} has head_type {raw.get('head_type')!r}, expected {HEAD_TYPE!r}")
        names = {f.name for f in fields(AcceptanceHeadConfig)}
        missing = {f.name for f in fields(AcceptanceHeadConfig) if f.default is MISSING} - raw.keys()
        if missing:
            raise ValueError(f"{source} lacks the keys {sorted(missing)}")
        return AcceptanceHeadConfig(**{k: raw[k] for k in names if k in raw})


class AcceptanceHeadModel(nn.Module):
    """(proposing hidden, token embedding, depth, sibling rank, scalars) -> acceptance logit."""

    def __init__(self, cfg: AcceptanceHeadConfig):
        super().__init__()
        self.cfg = cfg
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.embed_norm = nn.RMSNorm(cfg.embed_size, eps=cfg.rms_norm_eps)
        self.hidden_in = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.embed_in = nn.Linear(cfg.embed_size, cfg.intermediate_size, bias=False)
        self.scalar_in = nn.Linear(NUM_SCALARS, cfg.intermediate_size, bias=True)
        self.depth_bias = nn.Embedding(cfg.max_depth + 1, cfg.intermediate_size)
        self.rank_bias = nn.Embedding(cfg.max_rank, cfg.intermediate_size)
        self.out = nn.Linear(cfg.intermediate_size, 1, bias=True)
        for m in (self.hidden_in, self.embed_in, self.scalar_in, self.out):
            nn.init.normal_(m.weight, std=0.02)
        for m in (self.depth_bias, self.rank_bias):
            nn.init.zeros_(m.weight)

    def forward(self, hidden: torch.Tensor, token_part: torch.Tensor, depth: torch.Tensor, rank: torch.Tensor,
                scalars: torch.Tensor) -> torch.Tensor:
        """hidden [M, H]; token_part [M, I] = embed_in(embed_norm(embedding)) (see token_table);
        depth / rank [M] int64; scalars [M, NUM_SCALARS] -> logits [M] float32."""
        return self.logits(self.hidden_part(hidden), token_part, depth, rank, scalars)

    def hidden_part(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, H] proposing hidden -> [M, I] its contribution (siblings share it: see AcceptanceHead.local)."""
        return self.hidden_in(self.hidden_norm(hidden.float()))

    def logits(self, hidden_part: torch.Tensor, token_part: torch.Tensor, depth: torch.Tensor, rank: torch.Tensor,
               scalars: torch.Tensor) -> torch.Tensor:
        """`forward` from the hidden and token contributions ([M, I] each) -> logits [M] float32."""
        pre = (hidden_part + token_part + self.scalar_in(scalars.float())
               + self.depth_bias(depth.clamp(0, self.cfg.max_depth)) + self.rank_bias(rank.clamp(0, self.cfg.max_rank - 1)))
        return self.out(F.silu(pre))[:, 0]

    def token_part(self, embeds: torch.Tensor) -> torch.Tensor:
        """[M, He] token embeddings -> [M, I] their contribution (precomputed per vocabulary at inference)."""
        return self.embed_in(self.embed_norm(embeds.float()))


# ------------------------------------------------------------------------------------------ node features
def node_scalars(tree: DraftTree, context: list[int], followers: ContextFollowers | None = None) -> np.ndarray:
    """[N, NUM_SCALARS] float32: log q, log raw path score, copy features; batch of one."""
    logq = np.log(np.clip(tree.draft_probs[0].cpu().numpy(), 1e-8, 1.0))
    logs = np.clip(tree.log_scores[0].cpu().numpy(), -30.0, 0.0)
    return np.concatenate([logq[:, None], logs[:, None], copy_features(tree, context, followers)], 1).astype(np.float32)


# ------------------------------------------------------------------------------------------ inference
class AcceptanceHead:
    """Loading, checks, and the per-node local acceptance probability of a drafted tree."""

    def __init__(self, model: AcceptanceHeadModel):
        self.model = model.eval()
        self.config = model.cfg
        self._table: torch.Tensor | None = None  # [V, I] token parts
        self._host: HostHeadWeights | None = None  # the weights for the compiled CPU path, made on first use

    @staticmethod
    def load(directory: str | Path) -> "AcceptanceHead":
        directory = Path(directory)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"acceptance head: {directory / name} is missing")
        cfg = AcceptanceHeadConfig.from_json((directory / CONFIG_NAME).read_text(), str(directory / CONFIG_NAME))
        try:
            state = load_file(str(directory / WEIGHTS_NAME))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"acceptance head: cannot read {directory / WEIGHTS_NAME}: {err}") from None
        model = AcceptanceHeadModel(cfg)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if expected != {k: tuple(v.shape) for k, v in state.items()}:
            raise ValueError(f"acceptance head: {directory / WEIGHTS_NAME} does not match its config.json")
        model.load_state_dict({k: v.float() for k, v in state.items()})
        return AcceptanceHead(model)

    def save(self, directory: str | Path, dtype: torch.dtype = torch.float16) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(self.config.to_json())
        save_file({k: v.detach().to(dtype).contiguous() for k, v in self.model.state_dict().items()},
                  str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
        return directory

    def to(self, device: torch.device | str) -> "AcceptanceHead":
        """The head (and its bound token table) on `device`: where the drafter's node features are."""
        self.model.to(device)
        if self._table is not None:
            self._table = self._table.to(device)
        self._host = None
        return self

    def bind_embedding(self, embed: nn.Embedding) -> "AcceptanceHead":
        if tuple(embed.weight.shape) != (self.config.vocab_size, self.config.embed_size):
            raise ValueError(f"embedding of shape {tuple(embed.weight.shape)} does not match the acceptance head's "
                             f"(vocab_size, embed_size) = {(self.config.vocab_size, self.config.embed_size)}")
        with torch.no_grad():  # computed where the head is (the embedding may live on another device)
            self._table = self.model.token_part(embed.weight.to(self.model.out.weight.device))
        self._host = None
        return self

    @torch.no_grad()
    def local(self, tree: DraftTree, draft, context: list[int] | None,
              followers: ContextFollowers | None = None) -> torch.Tensor:
        """[1, N] sigmoid of the head: local acceptance probability of each valid node, 0 for the others
        (batch of one). `followers`: the request's context index (values.py keeps one per request)."""
        rows, per_row = _forward_rows(draft)
        if self._table is None:
            raise ValueError("call bind_embedding(target embedding) before local()")
        if tree.batch_size != 1 or rows.shape[0] != 1 or rows.shape[1] * per_row < tree.num_nodes:
            raise ValueError(f"the drafter's features {tuple(rows.shape)} ({per_row} nodes a row) do not match the "
                             f"tree {tuple(tree.token_ids.shape)}")
        device = self._table.device
        if tree.num_nodes == 0:
            return torch.zeros(1, 0, device=device)
        if device.type == "cpu" and compiled_head() is not None:
            out = self._compiled_local(tree.on_host(), rows, per_row, context or [], followers or ContextFollowers())
            if out is not None:
                return out
        hidden = rows if per_row == 1 else rows.repeat_interleave(per_row, dim=1)[:, :tree.num_nodes]  # [1, N, H]
        # the rank and copy features are host work on the tree (a few hundred ints): one upload each
        rank = to_device(torch.from_numpy(sibling_rank(tree)), device)
        scalars = to_device(torch.from_numpy(node_scalars(tree, context or [], followers)), device)
        # Only valid nodes are scored (the values read no other). Siblings share the hidden of the forward that
        # proposed them, so its projection, most of the head's arithmetic, runs once per parent (~N / topk rows).
        valid = np.flatnonzero(tree.valid[0].cpu().numpy())
        _, first, group = np.unique(tree.parents[0].cpu().numpy()[valid], return_index=True, return_inverse=True)
        scored, parent_rows = to_device(torch.from_numpy(valid), device), to_device(torch.from_numpy(valid[first]), device)
        hidden_part = self.model.hidden_part(hidden[0].to(device)[parent_rows])
        logits = self.model.logits(hidden_part[to_device(torch.from_numpy(group.reshape(-1)), device)],
                                   self._table[to_device(tree.token_ids[0], device)[scored]],
                                   to_device(tree.depth[0], device)[scored], rank[scored], scalars[scored])
        out = torch.zeros(tree.num_nodes, device=device)
        out[scored] = torch.sigmoid(logits)
        return out[None]

    def _compiled_local(self, host: DraftTree, rows: torch.Tensor, per_row: int, context: list[int],
                        followers: ContextFollowers) -> torch.Tensor | None:
        """`local` in one compiled call (acceptance_head_host.py), the copy features from the request's
        compiled n-gram tables; None when the tree is not in parent-first order (the torch path then runs)."""
        if self._host is None:
            self._host = HostHeadWeights.of(self.model, self._table)
        N = host.num_nodes
        copies = np.empty((N, NUM_SCALARS - 2), dtype=np.float32)
        if not copy_flags_of(host, context, followers, copies):
            return None
        w, out = self._host, np.empty(N, dtype=np.float32)
        ok = compiled_head()[0](
            host.token_ids[0].numpy(), host.parents[0].numpy(), host.depth[0].numpy(), host.draft_probs[0].numpy(),
            host.log_scores[0].numpy(), host.valid[0].numpy(), copies,
            np.ascontiguousarray(rows[0].detach().float().cpu().numpy()), per_row, w.norm, w.eps, w.hidden_in,
            w.token_part, w.scalar_in, w.scalar_bias, w.depth_bias, w.rank_bias, w.out, w.out_bias, out)
        return torch.from_numpy(out[None]) if ok else None


def _forward_rows(draft) -> tuple[torch.Tensor, int]:
    """([1, R, H] the drafter's pre-norm hidden per forward row, nodes per row): node v's features are row
    v // nodes-per-row. An EAGLE-3 draft (or the engine's `Draft` of one) gives its forward rows, whose
    siblings share one; anything else its per-node `node_hidden` (replay records)."""
    drafted = getattr(draft, "drafted", draft)
    if getattr(drafted, "row_hidden", None) is not None:
        return drafted.row_hidden, drafted.topk
    hidden = getattr(draft, "node_hidden", None)
    if hidden is None:
        raise ValueError("the acceptance head needs the EAGLE-3 drafter's node_hidden; this draft source has none "
                         "(use values='calibrated')")
    return hidden, 1


def load_head_values(directory: str | Path, target):
    """The 'head' value model: the acceptance head's local probability, composed along the path and
    corrected online by an identity-prior per-depth isotonic calibrator (core/values.py)."""
    from ..core.values import CalibratedValues, Calibrator

    if target is None:
        raise ValueError("values='head' needs the target's embedding")
    head = AcceptanceHead.load(directory).to(target.device)
    head.bind_embedding(target.input_embeddings())
    calibrator = Path(directory) / "calibrator.json"
    prior = Calibrator.load(calibrator) if calibrator.is_file() else Calibrator.identity(weight=50.0)
    return CalibratedValues(prior, local=head.local, name="head")


def write_random_acceptance_head(out_dir: str | Path, hidden_size: int, embed_size: int, vocab_size: int,
                                 seed: int = 0, init_std: float = 0.2) -> Path:
    """A randomly initialised acceptance head (varied, untrained outputs): for tests of the plumbing."""
    torch.manual_seed(seed)
    model = AcceptanceHeadModel(AcceptanceHeadConfig(hidden_size, embed_size, vocab_size, intermediate_size=32))
    with torch.no_grad():
        for name, t in model.named_parameters():
            if not name.endswith("norm.weight"):
                t.normal_(0.0, init_std)
    return AcceptanceHead(model).save(out_dir, dtype=torch.float32)
