"""The MoE target model: a Hugging Face Qwen3-MoE / GPT-OSS checkpoint adapted for
tree verification without forking its modeling file.

One forward verifies a whole selected tree: the root and the selected nodes are fed
with position ids `prefix_len + depth` and an additive float mask over prefix + tree
(`TreeLayout.attention_mask`; GPT-OSS gets the `{"full_attention", "sliding_attention"}`
mask dict with the window applied by position ids). The same forward captures, via
temporary hooks, the inputs of the EAGLE-3 capture layers and each MoE router's
top-k expert ids. `commit` compacts the KV cache so it holds exactly
prefix + root + accepted nodes, as if those tokens had been decoded one by one.

Two implementations run the same contract (`model_impl`):
- "lean" (default): our own forward (`lean_forward.py`) over the parameters transformers
  loaded, on a preallocated `StaticKVCache` with a slot per request; outputs come back as
  values and commit is one in-place gather.
- "hf": transformers' own forward with a `DynamicCache` without a config (every layer keeps
  full history, sliding windows applied by the mask) and temporary hooks for the captures.
  It is the reference the tests compare the lean forward against.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..core.device import host_tensor
from ..core.layout import TreeLayout
from .arch import ArchSpec, arch_spec, default_capture_layers, layer_types, router_topk_ids
from .checkpoint import check_safetensors_dir, load_hf_checked, parse_dtype
from .cuda_graphs import GraphCaptureError, StaticVerify, make_runner, warn_fallback
from .kv_cache import StaticKVCache
from .lean_forward import ForwardBatch, LeanForward

MODEL_IMPLS = ("lean", "hf")
DEFAULT_CACHE_LEN = 4096  # initial static-cache length per slot (grows on demand)


@dataclass(frozen=True)
class TargetOutput:
    """What one target forward returns to the engine."""

    logits: torch.Tensor  # [B, T, V] float32 (T = 1 for last-only prefill)
    hidden: torch.Tensor  # [B, T, 3*H] model dtype: inputs of the capture layers, concatenated (EAGLE-3 features)
    expert_ids: torch.Tensor  # [B, T, L_moe, topk] int64 router top-k expert ids per MoE layer


@dataclass
class TargetCache:
    """Per-request target KV state (mutable; owned by the engine, passed to every call)."""

    kv: object  # "hf": a transformers DynamicCache (full history in every layer); "lean": the shared StaticKVCache
    num_tokens: int = 0  # committed tokens in `kv` (the next verify's prefix_len)
    num_pending: int = 0  # tree slots appended by the last verify, dropped or kept by commit()
    slot: int = 0  # "lean": this request's slot in the StaticKVCache


class TargetModel:
    """A loaded MoE target with prefill / verify / commit over an explicit `TargetCache`."""

    def __init__(self, model: nn.Module, capture_layers: tuple[int, ...] | None = None, model_impl: str = "lean"):
        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}")
        config = model.config
        arch = (getattr(config, "architectures", None) or [type(model).__name__])[0]
        self.spec: ArchSpec = arch_spec(arch)
        self.model = model.eval()
        self.config = config
        self.num_layers: int = config.num_hidden_layers
        self.layer_types: tuple[str, ...] = layer_types(config, self.num_layers)
        self.sliding_window: int | None = getattr(config, "sliding_window", None)
        self.capture_layers = tuple(capture_layers) if capture_layers is not None else default_capture_layers(self.num_layers)
        if any(not 0 <= i < self.num_layers for i in self.capture_layers):
            raise ValueError(f"capture layers {self.capture_layers} out of range for {self.num_layers} layers")
        self.num_experts: int = getattr(config, self.spec.num_experts_attr)
        self.experts_per_token: int = config.num_experts_per_tok
        self.moe_layers, self._routers = self._find_routers()
        layers = model.get_submodule(self.spec.layers_path)
        self._capture_modules = [layers[i] for i in self.capture_layers]
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.model_impl = model_impl
        self._embed_weight = model.get_input_embeddings().weight  # Module.to() moves it in place
        self.lean: LeanForward | None = None
        self._pool: StaticKVCache | None = None
        self._runner_kind: str | None = None  # "graphs" / "static": bucketed static-shape forwards (cuda_graphs.py)
        self._runner_buckets: tuple[int, ...] = ()
        self._runners: dict[int, StaticVerify] = {}  # per cache slot
        if model_impl == "lean":
            _check_lean_supported(config)
            self.lean = LeanForward(model, self.spec.name, self.capture_layers, self.layer_types,
                                    self.sliding_window)

    # ----------------------------------------------------------------- loading
    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        capture_layers: tuple[int, ...] | None = None,
        model_impl: str = "lean",
    ) -> "TargetModel":
        """Load a local Hugging Face checkpoint directory (safetensors only, no remote code).
        `model_impl`: "lean" (our forward over the loaded weights) or "hf" (transformers' forward)."""
        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}")
        import transformers

        path = Path(path)
        config_dict = check_safetensors_dir(path, what="target checkpoint")
        arch = (config_dict.get("architectures") or ["<missing 'architectures' in config.json>"])[0]
        spec = arch_spec(arch)
        model_cls = getattr(transformers, spec.name, None)
        if model_cls is None:
            raise ValueError(f"transformers {transformers.__version__} has no {spec.name}; upgrade transformers")
        kwargs = {"use_safetensors": True, "trust_remote_code": False}
        if spec.attn_implementation is not None:
            kwargs["attn_implementation"] = spec.attn_implementation
        model = load_hf_checked(model_cls, path, "target checkpoint", dtype=parse_dtype(dtype), **kwargs)
        return cls(model.to(device), capture_layers=capture_layers, model_impl=model_impl)

    def _find_routers(self) -> tuple[tuple[int, ...], list[nn.Module]]:
        moe_layers, routers = [], []
        for i in range(self.num_layers):
            try:
                routers.append(self.model.get_submodule(self.spec.router_path.format(i=i)))
            except AttributeError:
                continue  # a dense layer (e.g. Qwen3-MoE mlp_only_layers)
            moe_layers.append(i)
        if not moe_layers:
            raise ValueError(f"no router modules found at {self.spec.router_path!r}: is this an MoE checkpoint?")
        return tuple(moe_layers), routers

    # --------------------------------------------------------------- properties
    @property
    def device(self) -> torch.device:
        return self._embed_weight.device  # read every step: the parameter is looked up once, in __init__

    @property
    def dtype(self) -> torch.dtype:
        return self._embed_weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        eos = eos if eos is not None else getattr(self.config, "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies across all layers."""
        head_dim = getattr(self.config, "head_dim", None) or self.hidden_size // self.config.num_attention_heads
        elem = torch.finfo(self.dtype).bits // 8
        return 2 * self.num_layers * self.config.num_key_value_heads * head_dim * elem

    def input_embeddings(self) -> nn.Embedding:
        """The target's token embedding (EAGLE-3 drafters without their own share it)."""
        return self.model.get_input_embeddings()

    def new_cache(self) -> TargetCache:
        """Per-request KV state: a slot of the shared static cache ("lean"; freed when the returned
        object is garbage-collected), or a fresh DynamicCache ("hf")."""
        if self.lean is None:
            from transformers import DynamicCache

            return TargetCache(kv=DynamicCache())
        if self._pool is None:
            # Cache indices are not positions: a verify's tree slots sit past the committed tokens,
            # so a request at the position limit still needs room for its tree. No cap here; the
            # API rejects prompts longer than the context.
            self._pool = self.lean.new_cache(min(DEFAULT_CACHE_LEN, self.max_position_embeddings + 256), num_slots=1)
        cache = TargetCache(kv=self._pool)
        cache.slot = self._pool.acquire(owner=cache)
        return cache

    def copy_prefix(self, dst: TargetCache, src: TargetCache, length: int) -> None:
        """Give the empty cache `dst` the first `length` committed positions of `src` (lean: both are
        slots of the one static cache; one copy over all layers), as if it had prefilled them."""
        if self.lean is None or dst.kv is not src.kv:
            raise ValueError("copy_prefix needs two slots of the lean forward's static cache")
        if dst.num_tokens or dst.num_pending:
            raise ValueError("copy_prefix fills an empty cache")
        if not 0 < length <= src.num_tokens:
            raise ValueError(f"copy_prefix of {length} positions from a cache holding {src.num_tokens}")
        kv = dst.kv.kv  # [layers, 2, slots, kv_heads, max_len, head_dim]
        kv[:, :, dst.slot, :, :length] = kv[:, :, src.slot, :, :length]
        dst.num_tokens = length

    def use_verify_runner(self, kind: str | None, buckets: tuple[int, ...] = ()) -> None:
        """Route lean forwards of up to max(buckets) tokens (verifies, plain steps, short prefills)
        through the static-shape forward of the smallest bucket that holds them: "graphs" replays
        a CUDA graph per bucket, captured on first use; "static" runs the same call eagerly (the
        CPU reference of what the graphs capture); None: the ordinary eager forward."""
        if kind is not None:
            if self.lean is None:
                raise ValueError("bucketed verify forwards need model_impl='lean'")
            if kind == "graphs" and self.device.type != "cuda":
                raise ValueError(f"CUDA graphs need a CUDA device, the target is on {self.device}")
            if not buckets:
                raise ValueError("use_verify_runner needs at least one bucket")
        self._runner_kind, self._runner_buckets, self._runners = kind, tuple(buckets), {}

    def verify_length(self, num_tokens: int) -> int:
        """The length a verify of `num_tokens` positions actually runs at: its bucket when bucketed
        forwards are on and it fits one, else itself."""
        if self._runner_kind is None or num_tokens > self._runner_buckets[-1]:
            return num_tokens
        return next(b for b in self._runner_buckets if b >= num_tokens)

    @property
    def verify_runner(self) -> str | None:
        """How short lean forwards run: "graphs", "static" or None (eager)."""
        return self._runner_kind

    # ------------------------------------------------------------------ forwards
    @torch.no_grad()
    def prefill(self, cache: TargetCache, input_ids: torch.Tensor, all_logits: bool = False) -> TargetOutput:
        """Append `input_ids` [1, T] causally after the committed tokens (prompt prefill,
        or plain one-by-one decoding). Logits are for the last position only unless
        `all_logits`; hidden and expert ids are for all T positions.
        """
        self._check_ready(cache, input_ids)
        P, T = cache.num_tokens, input_ids.shape[1]
        positions = torch.arange(P, P + T, device=self.device)[None]
        keep = 0 if all_logits else 1
        if self.lean is not None:
            out = self._lean_forward(cache, input_ids.to(self.device), positions, None, keep)
        else:
            mask = self._masks(lambda window: _causal_mask(P, T, self.dtype, self.device, window))
            out = self._forward(cache, input_ids.to(self.device), positions, mask, logits_to_keep=keep)
        cache.num_tokens = P + T
        return out

    @torch.no_grad()
    def forward_windows(self, input_ids: torch.Tensor) -> TargetOutput:
        """One causal forward over B independent windows input_ids [B, T] from position 0, all
        logits, nothing kept afterwards (training features)."""
        B, T = input_ids.shape
        input_ids = input_ids.to(self.device)
        positions = torch.arange(T, device=self.device)[None].expand(B, T)
        if self.lean is not None:
            pool = self.lean.new_cache(T, num_slots=B)
            batch = ForwardBatch(input_ids, positions, tuple(range(B)), (0,) * B, None, 0)
            out = self.lean.forward(pool, batch)
            return TargetOutput(logits=out.logits, hidden=out.hidden, expert_ids=out.expert_ids)
        mask = self._masks(lambda window: _causal_mask(0, T, self.dtype, self.device, window))
        return self._forward(self.new_cache(), input_ids, positions, mask, logits_to_keep=0)

    @torch.no_grad()
    def verify(self, cache: TargetCache, layout: TreeLayout) -> TargetOutput:
        """One forward over the root and the selected nodes of `layout` (batch 1).

        Returns logits [1, 1+K, V], capture hidden [1, 1+K, 3H] and expert ids
        [1, 1+K, L_moe, topk] at layout positions; the 1+K slots stay in the cache
        until `commit`.
        """
        if layout.batch_size != 1:
            raise ValueError(f"TargetModel.verify handles one request at a time, got a layout of batch {layout.batch_size}")
        # Drafted ids come from the drafter's own vocabulary map; reading their range back would be
        # a host sync before every verify on CUDA, so only CPU (where it is free) checks the values.
        self._check_ready(cache, layout.token_ids, check_values=self.device.type == "cpu")
        P = cache.num_tokens
        positions = layout.position_ids(P).to(self.device)
        if self.lean is not None:
            tree_mask = layout.tree_mask().to(self.device) if layout.num_positions > 1 else None
            out = self._lean_forward(cache, layout.token_ids.to(self.device), positions, tree_mask, 0)
        else:
            mask = self._masks(lambda window: layout.attention_mask(P, self.dtype, window).to(self.device))
            out = self._forward(cache, layout.token_ids.to(self.device), positions, mask, logits_to_keep=0)
        cache.num_pending = layout.num_positions
        return out

    @torch.no_grad()
    def commit(self, cache: TargetCache, accepted_pos: torch.Tensor) -> None:
        """Keep the root and the accepted layout positions `accepted_pos` [D] (-1 pad, in
        path order) of the last verify; drop every other tree slot. Afterwards the cache
        equals that of decoding root + accepted tokens one by one.
        """
        if cache.num_pending == 0:
            raise ValueError("commit() without a pending verify()")
        P, pending = cache.num_tokens, cache.num_pending
        accepted = [a for a in accepted_pos.reshape(-1).tolist() if a >= 0]  # a few ints: host lists
        if accepted and (max(accepted) >= pending or min(accepted) < 1):
            raise ValueError(f"accepted positions {accepted} out of the layout range 1..{pending - 1}")
        n = 1 + len(accepted)
        chain = accepted == list(range(1, n))  # the kept slots already sit behind the prefix, in order
        src = None if chain else host_tensor([P] + [P + a for a in accepted], self.device)
        if self.lean is not None:  # one gather over all layers; rejected slots are overwritten later
            if not chain:
                cache.kv.commit(cache.slot, P, src)
            cache.num_tokens, cache.num_pending = P + n, 0
            return
        for layer in cache.kv.layers:
            if not chain:  # copy accepted slots down; the source is gathered first, so no aliasing
                layer.keys[:, :, P : P + n] = layer.keys[:, :, src]
                layer.values[:, :, P : P + n] = layer.values[:, :, src]
            layer.keys = layer.keys[:, :, : P + n]
            layer.values = layer.values[:, :, : P + n]
        cache.num_tokens, cache.num_pending = P + n, 0

    @torch.no_grad()
    def discard(self, cache: TargetCache) -> None:
        """Drop every slot of the last verify (an analysis-only "peek" forward leaves no trace)."""
        P = cache.num_tokens
        if self.lean is None:  # the static cache needs nothing: the next forward overwrites the slots
            for layer in cache.kv.layers:
                layer.keys = layer.keys[:, :, :P]
                layer.values = layer.values[:, :, :P]
        cache.num_pending = 0

    # ------------------------------------------------------------------ helpers
    def _check_ready(self, cache: TargetCache, token_ids: torch.Tensor, check_values: bool = True) -> None:
        if cache.num_pending:
            raise ValueError("the cache has uncommitted tree slots: call commit() after verify()")
        if token_ids.dim() != 2 or token_ids.shape[0] != 1 or token_ids.shape[1] == 0:
            raise ValueError(f"expected token ids of shape [1, T>0], got {tuple(token_ids.shape)}")
        if not check_values:
            return
        low, high = (int(v) for v in torch.aminmax(token_ids))  # one reduction, one read back
        if high >= self.vocab_size or low < 0:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got range [{low}, {high}]")

    def _masks(self, build):
        """The attention-mask argument: one tensor, or the per-layer-type dict GPT-OSS takes."""
        if not self.spec.mask_by_layer_type:
            return build(self.sliding_window)
        masks = {"full_attention": build(None)}
        if "sliding_attention" in self.layer_types:
            masks["sliding_attention"] = build(self.sliding_window)
        return masks

    def _lean_forward(self, cache: TargetCache, input_ids, positions, tree_mask, logits_to_keep: int) -> TargetOutput:
        runner = self._runner(cache, input_ids.shape[1])
        if runner is not None:
            try:
                out = runner.run(input_ids, positions, cache.num_tokens, tree_mask)
            except GraphCaptureError as e:  # once: every later forward runs eagerly
                warn_fallback(e.__cause__ or e)
                self.use_verify_runner(None)
            else:
                logits = out.logits if logits_to_keep == 0 else out.logits[:, -logits_to_keep:]
                return TargetOutput(logits=logits, hidden=out.hidden, expert_ids=out.expert_ids)
        batch = ForwardBatch(input_ids, positions, (cache.slot,), (cache.num_tokens,), tree_mask, logits_to_keep)
        out = self.lean.forward(cache.kv, batch)
        return TargetOutput(logits=out.logits, hidden=out.hidden, expert_ids=out.expert_ids)

    def _runner(self, cache: TargetCache, num_tokens: int) -> StaticVerify | None:
        """This slot's bucketed runner when one is enabled and the forward fits its largest bucket
        (long prompt prefills stay eager, as EVICT's prefill does)."""
        if self._runner_kind is None or num_tokens > self._runner_buckets[-1]:
            return None
        runner = self._runners.get(cache.slot)
        if runner is None or runner.cache is not cache.kv:
            runner = make_runner(self._runner_kind, self.lean, cache.kv, cache.slot, self._runner_buckets)
            self._runners[cache.slot] = runner
        return runner

    def _forward(self, cache: TargetCache, input_ids, positions, mask, logits_to_keep: int) -> TargetOutput:
        recorder = _Recorder(self._capture_modules, self._routers, self.experts_per_token)
        with recorder:
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{self._cache_kwarg: cache.kv},
            )
        B, T = input_ids.shape
        return TargetOutput(
            logits=out.logits.float(),
            hidden=torch.cat(recorder.hidden, dim=-1),
            expert_ids=torch.stack(recorder.expert_ids, dim=1).reshape(B, T, len(self._routers), -1),
        )


class _Recorder(contextlib.AbstractContextManager):
    """Hooks that live for one forward: capture-layer inputs and router top-k ids."""

    def __init__(self, capture_modules: list[nn.Module], routers: list[nn.Module], top_k: int):
        self.hidden: list[torch.Tensor] = []
        self.expert_ids: list[torch.Tensor] = []  # per MoE layer: [B*T, topk]
        self._capture_modules, self._routers, self._top_k = capture_modules, routers, top_k
        self._handles = []

    def __enter__(self):
        for module in self._capture_modules:
            self._handles.append(module.register_forward_pre_hook(self._on_layer_input, with_kwargs=True))
        for router in self._routers:
            self._handles.append(router.register_forward_hook(self._on_router_output))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return False

    def _on_layer_input(self, module, args, kwargs):
        self.hidden.append(args[0] if args else kwargs["hidden_states"])

    def _on_router_output(self, module, args, output):
        self.expert_ids.append(router_topk_ids(output, self._top_k))


def _causal_mask(prefix_len: int, num_new: int, dtype, device, window: int | None) -> torch.Tensor:
    """[1, 1, T, P+T] additive causal mask for T new tokens after P cached ones."""
    q = torch.arange(prefix_len, prefix_len + num_new, device=device)[:, None]
    k = torch.arange(prefix_len + num_new, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= (q - k) < window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]



def _check_lean_supported(config) -> None:
    """The lean forward precomputes rotary tables: rope types whose frequencies depend on the
    running sequence length need transformers' forward."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind in ("dynamic", "longrope"):
        raise ValueError(f"rope_type {kind!r} is not supported by model_impl='lean'; use model_impl='hf'")
