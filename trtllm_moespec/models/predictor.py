"""EcoSpec's standalone expert predictor (paper §4.1, App. 8.1).

A small causal transformer Pi_theta over target-vocabulary tokens that outputs
routing logits z_t in R^{L x E} per token; softmax over experts per layer and a
top-K give the predicted expert set E_pred(t) = {(l, e) | e in TopK(p_t,l, K)}.
It never queries the target online. Ours is deliberately tiny (2 layers, width
128, its own embedding) so one call over a context window plus a 32-node tree
costs a few milliseconds on a CPU.

Inference entry points used by the engine:
- ``ExpertPredictor.load(dir)``: ``config.json`` + ``model.safetensors``;
  ``check_target(...)`` rejects a predictor trained for another target;
- ``predict_tree(context_ids, tree, batch_index)``: one forward over the last
  ``context_window`` committed tokens (the root = the last committed token is the
  last context token) followed by the tree nodes under a tree attention mask;
- ``predict_sequence(ids)``: plain causal prediction, for evaluation.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from trtllm_moespec.core.tree import DraftTree

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MODEL_TYPE = "moespec_expert_predictor"


@dataclass(frozen=True)
class PredictorConfig:
    """Shape of the predictor and the target whose routing it predicts."""

    vocab_size: int = 4096  # target vocabulary (inputs are target token ids)
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 384  # SwiGLU width
    max_seq_len: int = 256  # training window; longest sequence accepted
    context_window: int = 128  # committed tokens fed before the tree in predict_tree
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    target_num_layers: int = 4  # L: MoE layers of the target
    target_num_experts: int = 32  # E: routed experts per layer
    target_topk: int = 4  # K: experts per token per layer

    def to_json(self) -> str:
        return json.dumps({"model_type": MODEL_TYPE, **asdict(self)}, indent=2) + "\n"

    @staticmethod
    def from_json(text: str, source: str) -> "PredictorConfig":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source} is not valid JSON: {err}") from None
        if raw.get("model_type") != MODEL_TYPE:
            raise ValueError(f"{source} has model_type {raw.get('model_type')!r}, expected {MODEL_TYPE!r}")
        names = {f.name for f in fields(PredictorConfig)}
        missing = names - raw.keys()
        if missing:
            raise ValueError(f"{source} lacks the keys {sorted(missing)}")
        return PredictorConfig(**{k: raw[k] for k in names})


def _rope(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [B, H, T, D] at position_ids [B, T] (rotate-half form)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (torch.arange(half, dtype=torch.float32, device=x.device) / half))
    angles = position_ids.float()[:, None, :, None] * inv_freq  # [B, 1, T, D/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _Block(nn.Module):
    """Pre-norm attention + SwiGLU block."""

    def __init__(self, cfg: PredictorConfig):
        super().__init__()
        self.cfg = cfg
        inner = cfg.num_heads * cfg.head_dim
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.qkv = nn.Linear(cfg.hidden_size, 3 * inner, bias=False)
        self.o_proj = nn.Linear(inner, cfg.hidden_size, bias=False)
        self.mlp_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.cfg.num_heads, self.cfg.head_dim).unbind(2)
        q = _rope(q.transpose(1, 2), position_ids, self.cfg.rope_theta)
        k = _rope(k.transpose(1, 2), position_ids, self.cfg.rope_theta)
        attn = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), attn_mask=mask[:, None])
        x = x + self.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class PredictorModel(nn.Module):
    """Pi_theta: token ids -> routing logits [B, T, L, E]."""

    def __init__(self, cfg: PredictorConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.router_head = nn.Linear(cfg.hidden_size, cfg.target_num_layers * cfg.target_num_experts, bias=False)
        self.apply(_init_weights)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """input_ids, position_ids [B, T] int64; mask [B, T, T] bool (query attends key) -> [B, T, L, E]."""
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, position_ids, mask)
        logits = self.router_head(self.norm(x))
        return logits.view(*input_ids.shape, self.cfg.target_num_layers, self.cfg.target_num_experts)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)


def causal_mask(length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, T, T] bool lower-triangular mask."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None]


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: entry (i, j) is True when node j is node i or one of its ancestors.

    ``parents`` [N] int64 with -1 for children of the root and parent < child.
    """
    num_nodes = parents.shape[0]
    anc = torch.eye(num_nodes, dtype=torch.bool, device=parents.device)
    for i in range(num_nodes):  # topological order: a parent's row is final
        p = int(parents[i])
        if p >= 0:
            anc[i] |= anc[p]
    return anc


def tree_inputs(context_ids: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, node_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of one context+tree forward: (ids [1, C+N], positions [1, C+N], mask [1, C+N, C+N]).

    The context is causal; node i sees the whole context, its ancestors and itself;
    its position is (position of the root = C - 1) + depth.
    """
    C, N = context_ids.shape[0], node_ids.shape[0]
    mask = torch.zeros(C + N, C + N, dtype=torch.bool)
    mask[:C, :C] = causal_mask(C)[0]
    mask[C:, :C] = True
    mask[C:, C:] = ancestor_mask(parents)
    positions = torch.cat([torch.arange(C), (C - 1) + depth])
    return torch.cat([context_ids, node_ids])[None], positions[None], mask[None]


class ExpertPredictor:
    """Inference wrapper: loading, target checks and top-K expert predictions."""

    def __init__(self, model: PredictorModel):
        self.model = model.eval()
        self.config = model.cfg

    @staticmethod
    def load(directory: str | Path) -> "ExpertPredictor":
        directory = Path(directory)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"expert predictor: {directory / name} is missing")
        cfg = PredictorConfig.from_json((directory / CONFIG_NAME).read_text(), str(directory / CONFIG_NAME))
        try:
            state = load_file(str(directory / WEIGHTS_NAME))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"expert predictor: cannot read {directory / WEIGHTS_NAME}: {err}") from None
        model = PredictorModel(cfg)
        expected = {k: v.shape for k, v in model.state_dict().items()}
        got = {k: v.shape for k, v in state.items()}
        if expected != got:
            diff = sorted(set(expected.items()) ^ set(got.items()))[:4]
            raise ValueError(f"expert predictor: {directory / WEIGHTS_NAME} does not match its config.json (e.g. {diff})")
        model.load_state_dict({k: v.float() for k, v in state.items()})
        return ExpertPredictor(model)

    @property
    def device(self) -> torch.device:
        return self.model.router_head.weight.device

    def to(self, device: torch.device | str) -> "ExpertPredictor":
        """Move the weights (in place) and return self; predictions come back on ``device``."""
        self.model.to(device)
        return self

    def save(self, directory: str | Path, dtype: torch.dtype = torch.float16) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(self.config.to_json())
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.model.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})

    def check_target(self, num_layers: int, num_experts: int, topk: int, vocab_size: int) -> None:
        """Raise ValueError unless this predictor was trained for a target of this shape."""
        want = (self.config.target_num_layers, self.config.target_num_experts, self.config.target_topk, self.config.vocab_size)
        got = (num_layers, num_experts, topk, vocab_size)
        if want != got:
            raise ValueError(
                "expert predictor was trained for a target with (num_layers, num_experts, topk, vocab_size) = "
                f"{want}, but the target has {got}"
            )

    @torch.no_grad()
    def routing_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Raw z [B, T, L, E] (float32)."""
        return self.model(input_ids, position_ids, mask)

    def _topk(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.topk(self.config.target_topk, dim=-1).indices.sort(dim=-1).values

    @torch.no_grad()
    def predict_sequence(self, ids: torch.Tensor) -> torch.Tensor:
        """Predicted top-K experts of every token of ids [T]: [T, L, K] int64 (sorted ids)."""
        if ids.dim() != 1 or not 1 <= ids.shape[0] <= self.config.max_seq_len:
            raise ValueError(f"predict_sequence takes a 1-D sequence of 1..{self.config.max_seq_len} tokens, got shape {tuple(ids.shape)}")
        T, dev = ids.shape[0], self.device
        logits = self.model(ids.long().to(dev)[None], torch.arange(T, device=dev)[None], causal_mask(T, dev))
        return self._topk(logits[0])

    @torch.no_grad()
    def predict_tree(self, context_ids: torch.Tensor, tree: DraftTree, batch_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted experts of the tree nodes and of the root.

        context_ids [C] int64: committed tokens, the last one is the root.
        Returns (node_topk [N, L, K] int64, root_topk [L, K] int64) on the
        predictor's device. Padded nodes are run as children of the root; their
        rows are meaningless. The masks are built on the CPU (N is small).
        """
        if context_ids.dim() != 1 or context_ids.shape[0] < 1:
            raise ValueError(f"context_ids must be a non-empty 1-D tensor, got shape {tuple(context_ids.shape)}")
        if not 0 <= batch_index < tree.batch_size:
            raise ValueError(f"batch_index {batch_index} out of range for a tree batch of {tree.batch_size}")
        context = context_ids[-self.config.context_window :].long().cpu()
        valid = tree.valid[batch_index].cpu()
        parents = torch.where(valid, tree.parents[batch_index].cpu(), -1)
        depth = torch.where(valid, tree.depth[batch_index].cpu(), 1)
        ids, positions, mask = tree_inputs(context, parents, depth, tree.token_ids[batch_index].cpu())
        dev = self.device
        topk = self._topk(self.model(ids.to(dev), positions.to(dev), mask.to(dev))[0])
        C = context.shape[0]
        return topk[C:], topk[C - 1]


def topk_overlap(pred: torch.Tensor, true: torch.Tensor) -> float:
    """Mean |pred ∩ true| / K over tokens and layers; pred, true [..., K] int64."""
    if pred.shape != true.shape:
        raise ValueError(f"shape mismatch {tuple(pred.shape)} vs {tuple(true.shape)}")
    hits = (pred[..., :, None] == true[..., None, :]).any(-1).float()
    return hits.mean().item()


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def expected_loss_floor(topk: int) -> float:
    """Lower bound of the layer-wise CE with a uniform target over K experts: log K."""
    return math.log(topk)
