"""Our expert predictor: a light head on the EAGLE-3 drafter's hidden state.

EcoSpec's predictor (`predictor.py`) is a separate causal LM that needs its own
forward over context + tree every step. This head needs none: every drafted node
already has the pre-norm drafter hidden of the forward that proposed it
(`Eagle3Draft.node_hidden`), which summarises the context and the node's path up
to its parent; together with the node token's embedding (the target's, shared by
the drafter) a two-layer MLP maps it to routing logits [L, E] per node.

Root: the root token (last committed) was not proposed inside this step's tree.
Its feature is the drafter output at the last committed position, which has
*consumed* the root token (`Eagle3Cache.last_hidden`; it is also the proposing
hidden of every depth-1 node, so `node_hidden` of node 0 carries it). Because that
hidden has seen the token while a node's proposing hidden has not, the root has
its own input layer (`root_in`); the output layer is shared. A learned depth bias
(0 = root, 1..max_depth = node depth) lets the head weigh how stale the chain is.

Objective (EcoSpec §4.1): layer-wise cross-entropy against the uniform distribution
over the target router's top-K experts.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..core.device import token_tensor

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
PREDICTOR_TYPE = "draft_head"


@dataclass(frozen=True)
class HeadPredictorConfig:
    """Shape of the head and of the target / drafter it belongs to."""

    hidden_size: int  # drafter hidden width H (node_hidden)
    embed_size: int  # width of the token embedding fed with it (the target's)
    vocab_size: int  # target vocabulary (for checking)
    target_num_layers: int  # L: MoE layers of the target
    target_num_experts: int  # E
    target_topk: int  # K
    intermediate_size: int = 512
    max_depth: int = 8  # deeper nodes share the last depth bias
    rms_norm_eps: float = 1e-6

    def to_json(self) -> str:
        return json.dumps({"predictor_type": PREDICTOR_TYPE, **asdict(self)}, indent=2) + "\n"

    @staticmethod
    def from_json(text: str, source: str) -> "HeadPredictorConfig":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source} is not valid JSON: {err}") from None
        if raw.get("predictor_type") != PREDICTOR_TYPE:
            raise ValueError(f"{source} has predictor_type {raw.get('predictor_type')!r}, expected {PREDICTOR_TYPE!r}")
        names = {f.name for f in fields(HeadPredictorConfig)}
        required = {f.name for f in fields(HeadPredictorConfig) if f.default is MISSING}
        missing = required - raw.keys()
        if missing:
            raise ValueError(f"{source} lacks the keys {sorted(missing)}")
        return HeadPredictorConfig(**{k: raw[k] for k in names if k in raw})


def is_head_predictor_dir(directory: str | Path) -> bool:
    """True when directory/config.json declares a draft-head predictor."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("predictor_type") == PREDICTOR_TYPE
    except (json.JSONDecodeError, AttributeError):
        return False


class HeadPredictorModel(nn.Module):
    """(proposing hidden, token embedding, depth) -> routing logits [..., L, E]."""

    def __init__(self, cfg: HeadPredictorConfig):
        super().__init__()
        self.cfg = cfg
        width = cfg.hidden_size + cfg.embed_size
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.embed_norm = nn.RMSNorm(cfg.embed_size, eps=cfg.rms_norm_eps)
        self.node_in = nn.Linear(width, cfg.intermediate_size, bias=False)
        self.root_in = nn.Linear(width, cfg.intermediate_size, bias=False)
        self.depth_bias = nn.Embedding(cfg.max_depth + 1, cfg.intermediate_size)
        self.out = nn.Linear(cfg.intermediate_size, cfg.target_num_layers * cfg.target_num_experts, bias=True)
        for m in (self.node_in, self.root_in, self.out):
            nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(self.depth_bias.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], embeds [..., He], depth [...] int64 (0 = root) -> logits [..., L, E] float32."""
        x = torch.cat([self.hidden_norm(hidden.float()), self.embed_norm(embeds.float())], dim=-1)
        is_root = (depth == 0)[..., None]
        pre = torch.where(is_root, self.root_in(x), self.node_in(x))
        return self._head(pre, depth)

    def _head(self, pre: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        pre = pre + self.depth_bias(depth.clamp(0, self.cfg.max_depth))
        logits = self.out(F.silu(pre))
        return logits.view(*depth.shape, self.cfg.target_num_layers, self.cfg.target_num_experts)

    @torch.no_grad()
    def token_tables(self, embed_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The token half of node_in / root_in for every vocabulary entry: ([V, I], [V, I]).

        node_in(cat(a, b)) = W[:, :H] a + W[:, H:] b, so inference needs only the hidden half per node."""
        e = self.embed_norm(embed_weight.float())
        H = self.cfg.hidden_size
        return F.linear(e, self.node_in.weight[:, H:]), F.linear(e, self.root_in.weight[:, H:])

    def forward_tables(self, hidden: torch.Tensor, token_ids: torch.Tensor, depth: torch.Tensor,
                       tables: tuple[torch.Tensor, torch.Tensor], root_last: bool = False) -> torch.Tensor:
        """Same as forward() with the token halves looked up: hidden [M, H], token_ids / depth [M]; roots
        (depth 0) and nodes are computed on their own rows only. `root_last`: the last row is the only
        root (inference), so the rows split by position instead of by a mask read back from the device."""
        H = self.cfg.hidden_size
        h = self.hidden_norm(hidden.float())
        if root_last:
            node = F.linear(h[:-1], self.node_in.weight[:, :H]) + tables[0][token_ids[:-1]]
            root = F.linear(h[-1:], self.root_in.weight[:, :H]) + tables[1][token_ids[-1:]]
            return self._head(torch.cat([node, root]), depth)
        is_root = depth == 0
        pre = torch.empty(h.shape[0], self.cfg.intermediate_size, dtype=h.dtype, device=h.device)
        for mask, layer, table in ((~is_root, self.node_in, tables[0]), (is_root, self.root_in, tables[1])):
            if bool(mask.any()):
                pre[mask] = F.linear(h[mask], layer.weight[:, :H]) + table[token_ids[mask]]
        return self._head(pre, depth)


def head_loss(logits: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Layer-wise CE against the uniform distribution over the top-K: logits [..., L, E], topk_ids [..., L, K]."""
    return -F.log_softmax(logits.float(), dim=-1).gather(-1, topk_ids).mean()


class DraftHeadPredictor:
    """Inference wrapper: loading, target checks, top-K predictions for a drafted tree."""

    def __init__(self, model: HeadPredictorModel):
        self.model = model.eval()
        self.config = model.cfg
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def bind_embedding(self, embed: nn.Embedding) -> "DraftHeadPredictor":
        """Precompute the token halves of the input layers from the (target's) embedding; returns self."""
        if tuple(embed.weight.shape) != (self.config.vocab_size, self.config.embed_size):
            raise ValueError(f"embedding of shape {tuple(embed.weight.shape)} does not match the head's "
                             f"(vocab_size, embed_size) = {(self.config.vocab_size, self.config.embed_size)}")
        self._tables = self.model.token_tables(embed.weight.to(self.device))
        return self

    @staticmethod
    def load(directory: str | Path) -> "DraftHeadPredictor":
        directory = Path(directory)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"draft-head expert predictor: {directory / name} is missing")
        cfg = HeadPredictorConfig.from_json((directory / CONFIG_NAME).read_text(), str(directory / CONFIG_NAME))
        try:
            state = load_file(str(directory / WEIGHTS_NAME))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"draft-head expert predictor: cannot read {directory / WEIGHTS_NAME}: {err}") from None
        model = HeadPredictorModel(cfg)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        got = {k: tuple(v.shape) for k, v in state.items()}
        if expected != got:
            diff = sorted(set(expected.items()) ^ set(got.items()))[:4]
            raise ValueError(f"draft-head expert predictor: {directory / WEIGHTS_NAME} does not match its config.json "
                             f"(e.g. {diff})")
        model.load_state_dict({k: v.float() for k, v in state.items()})
        return DraftHeadPredictor(model)

    def save(self, directory: str | Path, dtype: torch.dtype = torch.float16) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(self.config.to_json())
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.model.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
        return directory

    @property
    def device(self) -> torch.device:
        return self.model.out.weight.device

    def to(self, device: torch.device | str) -> "DraftHeadPredictor":
        self.model.to(device)
        if self._tables is not None:
            self._tables = tuple(t.to(device) for t in self._tables)
        return self

    def check_target(self, num_layers: int, num_experts: int, topk: int, vocab_size: int, hidden_size: int) -> None:
        """Raise ValueError unless this head was trained for a target / drafter of this shape."""
        c = self.config
        want = (c.target_num_layers, c.target_num_experts, c.target_topk, c.vocab_size, c.embed_size)
        got = (num_layers, num_experts, topk, vocab_size, hidden_size)
        if want != got:
            raise ValueError("draft-head expert predictor was trained for a target with (num_layers, num_experts, "
                             f"topk, vocab_size, hidden_size) = {want}, but the target has {got}")

    def _topk(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.topk(self.config.target_topk, dim=-1).indices.sort(dim=-1).values

    @torch.no_grad()
    def predict(self, node_hidden: torch.Tensor, node_ids: torch.Tensor, node_depth: torch.Tensor,
                root_hidden: torch.Tensor, root_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """node_hidden [N, H], node_ids [N] token ids, node_depth [N] (values < 1 are treated as 1),
        root_hidden [H], root_id -> (node_topk [N, L, K], root_topk [L, K]) int64 sorted expert ids.
        Needs bind_embedding() first."""
        topk = self._topk(self.predict_logits(node_hidden, node_ids, node_depth, root_hidden, root_id))
        return topk[:-1], topk[-1]

    @torch.no_grad()
    def predict_logits(self, node_hidden: torch.Tensor, node_ids: torch.Tensor, node_depth: torch.Tensor,
                       root_hidden: torch.Tensor, root_id: int) -> torch.Tensor:
        """`predict`'s routing logits before the top-K: [N + 1, L, E] float32, the root's last."""
        if self._tables is None:
            raise ValueError("call bind_embedding(target embedding) before predict()")
        if node_hidden.dim() != 2 or node_hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(f"node_hidden must be [N, {self.config.hidden_size}], got {tuple(node_hidden.shape)}")
        if node_ids.shape != node_hidden.shape[:1] or node_depth.shape != node_hidden.shape[:1]:
            raise ValueError(f"node_ids {tuple(node_ids.shape)} / node_depth {tuple(node_depth.shape)} do not "
                             f"match node_hidden {tuple(node_hidden.shape)}")
        dev = self.device
        hidden = torch.cat([node_hidden.to(dev, torch.float32), root_hidden.to(dev, torch.float32)[None]])
        ids = torch.cat([node_ids.to(dev, torch.int64), token_tensor(int(root_id), dev)])
        depth = torch.cat([node_depth.to(dev).clamp(min=1), torch.zeros(1, dtype=torch.int64, device=dev)])
        return self.model.forward_tables(hidden, ids, depth, self._tables, root_last=True)
