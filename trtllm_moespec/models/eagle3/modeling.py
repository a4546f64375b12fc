"""EAGLE-3 drafter in the SpecForge / SGLang checkpoint format (`LlamaForCausalLMEagle3`).

Architecture (SGLang `llama_eagle3.py`, SpecForge `llama3_eagle.py`): one decoder
layer whose attention takes 2H inputs, the concatenation of
`input_layernorm(embed(token))` and `hidden_norm(h)`; the residual stream starts
at h. On the first draft step h = fc(concat of the target's three captured hidden
states) [3*H_target -> H]; on later steps h is the drafter's own pre-norm output
(the residual stream after the MLP) at the parent node. Logits come from
`lm_head(norm(h_out))` over the draft vocabulary; a draft id d maps to the target
id `d + d2t[d]`.

Pairing (EAGLE-3): drafter position t holds (embedding of token t+1, target hidden
at position t) and predicts token t+2. So after the target has processed tokens
x_0..x_{n-1} and x_n is the next (root) token, the drafter cache holds positions
0..n-1 with tokens x_1..x_n and the last position's output proposes the root's
children. `prefill` and `commit` take care of this pairing.

This module holds the network and its per-request cache operations (prefill, extend, commit);
its layers are in `layers.py`, the cache in `cache.py`, checkpoint I/O in `loading.py` and tree
drafting in `drafting.py`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .cache import DrafterKVPool, Eagle3Cache
from .layers import _FusedWeights, _MidLayer, _rms, _RMSNorm, _rotary, _rotate_half, causal_mask
from .types import Eagle3Config, Eagle3Output, PackedSegment


class Eagle3Drafter(nn.Module):
    """The EAGLE-3 head. Parameter names match the checkpoint's tensor names."""

    def __init__(self, config: Eagle3Config, embed_tokens: nn.Embedding | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens if embed_tokens is not None else nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = _MidLayer(config)
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.rotary_emb = _rotary(config)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [positions, D]
        self._fused: _FusedWeights | None = None  # inference weights, built on first use (_fused_weights)
        self._rope_signed_table: tuple[torch.Tensor, torch.Tensor] | None = None  # (source cos table, [P, 2, 1, D])
        self.kv_pool = DrafterKVPool()  # per-request K/V buffers, reused across requests

    # ------------------------------------------------------------------ network
    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache_kv: torch.Tensor | None = None,
        cache_start: int = 0,
    ) -> Eagle3Output:
        """One pass of the head over T positions (training or inference).

        hidden_states: [B, T, 3*H_target] target features (projected by fc) or [B, T, H] the
        drafter's own pre-norm outputs. input_ids [B, T] or inputs_embeds [B, T, H]: the tokens
        paired with them. position_ids [B, T] (default: S..S+T-1 after the S past positions).
        attention_mask: additive float [B, 1, T, S+T] (default: causal; None reaches `_attend` only when
        S == 0, where SDPA's own top-left causal mask is the same). past_kv: keys/values
        [B, KVH, S, D] to attend to before this forward's own positions (not modified).
        cache_kv [2, B, KVH, capacity, D] with cache_start=S instead: the S past positions are
        read from it and this forward's keys/values are written in place at S..S+T-1; position_ids
        must then be < S + T (no query sits past its own key slot; tree drafting's do not).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        embeds, h = self._inputs(hidden_states, input_ids, inputs_embeds)
        B, T, _ = h.shape
        S = cache_start if cache_kv is not None else (0 if past_kv is None else past_kv[0].shape[2])
        # 1 + the largest position when known on the host (see _rope_cos_sin): a position never passes
        # its own key slot, so with cache_kv every position is < S + T.
        rope_bound = S + T if position_ids is None or cache_kv is not None else None
        if position_ids is None:
            position_ids = torch.arange(S, S + T, device=h.device).expand(B, T)
        if attention_mask is None and (S > 0 or T == 1):
            attention_mask = causal_mask(S, T, h.dtype, h.device)
        # else (no past, several positions, e.g. a prefill): attention_mask stays None = plain causal, which
        # SDPA applies itself, skipping the blocks above the diagonal and no [T, T] mask is built
        if not torch.is_grad_enabled():  # inference: fused weights (no autograd through them needed)
            return self._forward_fused(embeds, h, position_ids, attention_mask, past_kv, cache_kv, S, rope_bound)
        # Functional calls on the modules' parameters: the same math, without nn.Module call overhead.
        layer, eps = self.midlayer, self.config.rms_norm_eps
        x = torch.cat([_rms(embeds, layer.input_layernorm.weight, eps), _rms(h, layer.hidden_norm.weight, eps)], dim=-1)
        attn, keys, values = self._attention(x, position_ids, attention_mask, past_kv, cache_kv, S, rope_bound)
        h = h + attn
        mlp, y = layer.mlp, _rms(h, layer.post_attention_layernorm.weight, eps)
        h = h + F.linear(mlp.act_fn(F.linear(y, mlp.gate_proj.weight)) * F.linear(y, mlp.up_proj.weight),
                         mlp.down_proj.weight)
        logits = F.linear(_rms(h, self.norm.weight, eps), self.lm_head.weight).float()
        return Eagle3Output(logits=logits, hidden=h, keys=keys, values=values)

    def _inputs(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None,
                inputs_embeds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(token embeddings, h [B, T, H]) in the drafter's dtype; target features are projected by fc."""
        embeds = F.embedding(input_ids, self.embed_tokens.weight) if inputs_embeds is None else inputs_embeds
        embeds = embeds.to(self.fc.weight.dtype)
        h = hidden_states.to(self.fc.weight.dtype)
        if h.shape[-1] == self.fc.in_features:
            h = F.linear(h, self.fc.weight)
        elif h.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden_states width {h.shape[-1]} is neither 3*target_hidden_size "
                             f"({self.fc.in_features}) nor hidden_size ({self.config.hidden_size})")
        return embeds, h

    @torch.no_grad()
    def forward_packed(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                       segments: "list[PackedSegment]") -> Eagle3Output:
        """Several requests' positions in one inference forward: hidden_states [1, R, 3*H_target or H],
        input_ids and position_ids [1, R], where segment b owns the next `segments[b].length` rows.
        Every row-wise op (norms, matmuls, the lm_head) runs once over all R rows: on this machine a
        forward over 64 rows costs about 4 over 8 (bound by reading the weights). Attention runs per
        segment, over that request's own buffer, written in place as `forward` does with cache_kv.
        A row's outputs are what `forward` gives it alone, up to matmul rounding (a GEMM may round a
        row differently with the number of rows it is given)."""
        if sum(seg.length for seg in segments) != input_ids.shape[1]:
            raise ValueError(f"the segments cover {sum(seg.length for seg in segments)} rows, the inputs "
                             f"{input_ids.shape[1]}")
        if len(segments) == 1:
            seg = segments[0]
            return self.forward(hidden_states, input_ids=input_ids, position_ids=position_ids,
                                attention_mask=seg.attention_mask, cache_kv=seg.cache_kv, cache_start=seg.start)
        embeds, h = self._inputs(hidden_states, input_ids, None)
        bound = max(seg.start + seg.length for seg in segments)  # no position passes its own key slot
        return self._forward_fused(embeds, h, position_ids, None, None, None, 0, bound, segments)

    def _attention(self, x, position_ids, attention_mask, past_kv, cache_kv=None, start: int = 0,
                   rope_bound: int | None = None):
        a = self.midlayer.self_attn
        B, T, _ = x.shape
        q = F.linear(x, a.q_proj.weight).view(B, T, a.num_heads, a.head_dim).transpose(1, 2)
        k = F.linear(x, a.k_proj.weight).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = F.linear(x, a.v_proj.weight).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        cos, sin = self._rope(x, position_ids, rope_bound)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return self._attend(q, k, v, attention_mask, past_kv, cache_kv, start)

    def _attend(self, q, k, v, attention_mask, past_kv, cache_kv, start: int):
        """Attention of q [B, Hq, T, D] over the past keys/values and k, v [B, KVH, T, D] (written into
        cache_kv at start.. when given), then o_proj -> ([B, T, H], k, v). attention_mask None: causal,
        only used with no past positions (SDPA's causal mask is aligned top-left)."""
        out = self._sdpa(q, k, v, attention_mask, past_kv, cache_kv, start)
        return F.linear(out, self.midlayer.self_attn.o_proj.weight), k, v

    def _attend_packed(self, q, k, v, segments: "list[PackedSegment]"):
        """`_attend` of packed rows [1, heads, R, D]: each segment's rows over its own buffer and
        mask (None: causal after its `start` positions, as `forward` defaults), one o_proj for all."""
        outs, row = [], 0
        for seg in segments:
            rows = slice(row, row + seg.length)
            mask = seg.attention_mask
            if mask is None and (seg.start > 0 or seg.length == 1):
                mask = causal_mask(seg.start, seg.length, q.dtype, q.device)
            outs.append(self._sdpa(q[:, :, rows], k[:, :, rows], v[:, :, rows], mask, None, seg.cache_kv, seg.start))
            row += seg.length
        return F.linear(torch.cat(outs, dim=1), self.midlayer.self_attn.o_proj.weight), k, v

    def _sdpa(self, q, k, v, attention_mask, past_kv, cache_kv, start: int) -> torch.Tensor:
        """`_attend` before o_proj: [B, T, Hq * D]."""
        a = self.midlayer.self_attn
        B, _, T, _ = q.shape
        if cache_kv is not None:  # write in place, read the prefix and this forward's keys as views
            cache_kv[0, :, :, start:start + T] = k
            cache_kv[1, :, :, start:start + T] = v
            all_k, all_v = cache_kv[0, :, :, :start + T], cache_kv[1, :, :, :start + T]
        else:
            all_k = k if past_kv is None else torch.cat([past_kv[0], k], dim=2)
            all_v = v if past_kv is None else torch.cat([past_kv[1], v], dim=2)
        mask = None if attention_mask is None else attention_mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, all_k, all_v, attn_mask=mask, is_causal=attention_mask is None,
                                             enable_gqa=a.num_heads != a.num_kv_heads)
        return out.transpose(1, 2).reshape(B, T, a.num_heads * a.head_dim)

    def _forward_fused(self, embeds, h, position_ids, attention_mask, past_kv, cache_kv, start: int,
                       rope_bound: int | None = None, segments: "list[PackedSegment] | None" = None) -> Eagle3Output:
        """The layer with q/k/v in one matmul, gate/up in one matmul, both input norms in one and rotary
        on q and k together (same math as the unfused path; per-op overhead dominates at these sizes).
        With `segments` the rows are packed requests (`forward_packed`)."""
        fused, eps = self._fused_weights(), self.config.rms_norm_eps
        a = self.midlayer.self_attn
        B, T, H = h.shape
        x = _rms(torch.stack([embeds, h], dim=2), fused.input_norms, eps).view(B, T, 2 * H)
        heads = a.num_heads + 2 * a.num_kv_heads
        qkv = F.linear(x, fused.qkv).view(B, T, heads, a.head_dim)
        cos, sin_signed = self._rope_signed(qkv, position_ids, rope_bound)
        qk = qkv[:, :, :a.num_heads + a.num_kv_heads]
        # rotate_half(x) * sin == roll(x, D/2) * (sin with its first half negated), bit for bit
        qk = qk * cos + qk.roll(a.head_dim // 2, dims=-1) * sin_signed
        q = qk[:, :, :a.num_heads].transpose(1, 2)
        k = qk[:, :, a.num_heads:].transpose(1, 2)
        v = qkv[:, :, a.num_heads + a.num_kv_heads:].transpose(1, 2)
        if segments is None:
            attn, keys, values = self._attend(q, k, v, attention_mask, past_kv, cache_kv, start)
        else:
            attn, keys, values = self._attend_packed(q, k, v, segments)
        h = h + attn
        gate, up = F.linear(_rms(h, fused.post_attention_norm, eps), fused.gate_up).chunk(2, dim=-1)
        h = h + F.linear(self.midlayer.mlp.act_fn(gate) * up, fused.down)
        logits = F.linear(_rms(h, fused.final_norm, eps), self.lm_head.weight).float()
        return Eagle3Output(logits=logits, hidden=h, keys=keys, values=values)

    def _fused_weights(self) -> "_FusedWeights":
        """The concatenated weights, rebuilt whenever a source weight was replaced or modified in place
        (load, .to(), training steps, a new module): keyed by each tensor's storage and version counter."""
        sources = self._fused_sources()
        key = tuple((t.data_ptr(), t._version) for t in sources)
        if self._fused is None or self._fused.key != key:
            with torch.no_grad():
                self._fused = _FusedWeights(
                    key=key, qkv=torch.cat(sources[:3]), gate_up=torch.cat(sources[4:6]), down=sources[6].detach(),
                    input_norms=torch.stack(sources[7:9]), post_attention_norm=sources[9].detach(),
                    final_norm=sources[10].detach())
        return self._fused

    def _fused_sources(self) -> tuple[torch.Tensor, ...]:
        """q, k, v, o, gate, up, down, input_layernorm, hidden_norm, post_attention_layernorm, norm weights.
        Read through the module dicts: nn.Module attribute lookups cost more than the check itself."""
        layer = self._modules["midlayer"]._modules
        attn, mlp = layer["self_attn"]._modules, layer["mlp"]._modules

        def weight(module: nn.Module) -> torch.Tensor:
            return module._parameters["weight"]

        return (weight(attn["q_proj"]), weight(attn["k_proj"]), weight(attn["v_proj"]), weight(attn["o_proj"]),
                weight(mlp["gate_proj"]), weight(mlp["up_proj"]), weight(mlp["down_proj"]),
                weight(layer["input_layernorm"]), weight(layer["hidden_norm"]), weight(layer["post_attention_layernorm"]),
                weight(self._modules["norm"]))

    def _rope_signed(self, x: torch.Tensor, position_ids: torch.Tensor,
                     bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin with its first half negated), each [B, T, 1, D], at position_ids [B, T]: one gather
        from a [positions, 2, 1, D] table made from `_rope`'s (rebuilt when that one grows or changes)."""
        source = self._rope_cos_sin(x, position_ids, bound)
        table = self._rope_signed_table
        if table is None or table[0] is not source[0]:
            cos, sin = source
            half = sin.shape[-1] // 2
            signed = torch.stack([cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)], dim=1)[:, :, None]
            table = self._rope_signed_table = (source[0], signed)
        cs = table[1][position_ids]  # [B, T, 2, 1, D]
        return cs[:, :, 0], cs[:, :, 1]

    def _rope(self, x: torch.Tensor, position_ids: torch.Tensor, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, T, D] gathered from a table the rotary module filled once (same float ops
        as calling it per forward; the table grows when a position past it appears)."""
        cos, sin = self._rope_cos_sin(x, position_ids, bound)
        return cos[position_ids][:, None], sin[position_ids][:, None]

    def _rope_cos_sin(self, x: torch.Tensor, position_ids: torch.Tensor,
                      bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) tables [positions, D] in x's dtype/device, covering position_ids (all < bound
        when bound is given)."""
        table = self._rope_table
        covered = table is not None and table[0].dtype == x.dtype and table[0].device == x.device
        # Positions may pass max_position_embeddings (a long request); the table then grows, doubling.
        # `bound` (1 + the largest position, when the caller knows it on the host) avoids reading the
        # positions. Without it they are read, except on an accelerator once the table covers
        # max_position_embeddings: there a read is a device sync (and is illegal in a CUDA graph
        # capture), so such callers must pass `bound` when positions can go further.
        if bound is not None:
            need = bound
        elif x.device.type != "cpu" and covered and table[0].shape[0] >= self.config.max_position_embeddings:
            need = 0
        else:
            need = int(position_ids.max()) + 1
        if not covered or table[0].shape[0] < need:
            length = max(need, self.config.max_position_embeddings, 2 * table[0].shape[0] if covered else 0)
            cos, sin = self.rotary_emb(x, torch.arange(length, device=x.device)[None])
            table = self._rope_table = (cos[0], sin[0])
        return table

    def draft_vocab_target_ids(self) -> torch.Tensor:
        """[V_draft] the target id of every draft-vocabulary token (cached per d2t table)."""
        d2t = self._buffers["d2t"]
        key = (d2t.data_ptr(), d2t._version)  # a load writes the buffer in place: its version changes
        cached = getattr(self, "_draft_vocab_ids", None)
        if cached is None or cached[0] != key:
            cached = self._draft_vocab_ids = (key, self.to_target_ids(torch.arange(d2t.numel(), device=d2t.device)))
        return cached[1]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids: d + d2t[d]."""
        d2t = self._buffers["d2t"]  # a module attribute lookup costs more than the lookup itself
        if draft_ids.device.type == "cpu" and d2t.device.type == "cpu" and draft_ids.dtype == torch.int64:
            ids = draft_ids.numpy()  # small index arithmetic: numpy is ~10x cheaper per op than torch here
            return torch.from_numpy(ids + d2t.numpy()[ids])
        return draft_ids + d2t[draft_ids]

    @torch.no_grad()
    def prune_vocab(self, keep_target_ids: torch.Tensor) -> "Eagle3Drafter":
        """Restrict the draft vocabulary to the target ids `keep_target_ids` [N] (in place, no
        retraining): lm_head keeps the rows of those tokens and d2t / t2d describe the new set
        (the SpecForge format). The softmax then runs over N rows instead of draft_vocab_size:
        the top-k among kept tokens is unchanged, their probabilities are renormalised over the
        kept set, and tokens outside it can no longer be proposed (drafting stays lossless)."""
        current = self.to_target_ids(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))
        wanted = torch.zeros(self.config.vocab_size, dtype=torch.bool, device=self.d2t.device)
        wanted[keep_target_ids.to(self.d2t.device).long()] = True
        rows = wanted[current].nonzero()[:, 0]  # draft ids to keep, ascending target ids stay ascending
        if rows.numel() == 0:
            raise ValueError("prune_vocab would leave an empty draft vocabulary")
        head = nn.Linear(self.config.hidden_size, rows.numel(), bias=False).to(self.lm_head.weight)
        head.weight.copy_(self.lm_head.weight[rows])
        self.lm_head = head
        kept = current[rows]
        self.d2t = kept - torch.arange(kept.numel(), device=kept.device)
        self.t2d = torch.zeros_like(self.t2d)
        self.t2d[kept] = True
        from dataclasses import replace

        self.config = replace(self.config, draft_vocab_size=int(kept.numel()))
        return self

    # -------------------------------------------------------- per-request cache
    def new_cache(self) -> Eagle3Cache:
        """A request's drafter cache, its K/V buffer taken from (and returned to) the drafter's pool."""
        return Eagle3Cache(pool=self.kv_pool)

    @torch.no_grad()
    def extend(self, cache: Eagle3Cache, token_ids: torch.Tensor, target_hidden: torch.Tensor,
               top: int = 0) -> torch.Tensor | None:
        """Append n drafter positions: token_ids [1, n] paired with target_hidden [1, n, 3*H_target]
        (hidden of the target position *before* each token). Updates the last-position outputs. With
        `top` > 0, returns each new position's `top` most likely next tokens as target ids, [n, top]
        (else None)."""
        if token_ids.dim() != 2 or token_ids.shape[0] != 1 or target_hidden.shape[:2] != token_ids.shape:
            raise ValueError(f"extend expects token_ids [1, n] and target_hidden [1, n, 3H], got "
                             f"{tuple(token_ids.shape)} and {tuple(target_hidden.shape)}")
        if token_ids.shape[1] == 0:
            return token_ids.new_zeros(0, top) if top else None
        S, n = cache.num_tokens, token_ids.shape[1]
        a = self.midlayer.self_attn
        kv = cache.reserve(S + n, a.num_kv_heads, a.head_dim, self.lm_head.weight.dtype, self.lm_head.weight.device)
        # forward itself (no hooks on the drafter): Module.__call__ costs ~15 us a call in a CPU step (issue 25)
        out = self.forward(target_hidden, input_ids=token_ids.to(self.lm_head.weight.device), cache_kv=kv, cache_start=S)
        cache.num_tokens = S + n
        cache.last_logits, cache.last_hidden = out.logits[:, -1], out.hidden[:, -1]
        return self.top_target_ids(out.logits[0], top) if top else None

    def top1_target_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [n, V_draft] -> [n] the target id of each row's most likely draft token."""
        return self.to_target_ids(logits.argmax(-1))

    def top_target_ids(self, logits: torch.Tensor, top: int) -> torch.Tensor:
        """logits [n, V_draft] -> [n, top] the target ids of each row's `top` most likely draft tokens."""
        return self.to_target_ids(logits.topk(top, dim=-1).indices)

    @torch.no_grad()
    def extend_packed(self, caches: list[Eagle3Cache], token_ids: list[torch.Tensor],
                      target_hidden: list[torch.Tensor]) -> None:
        """`extend` of several requests' caches (token_ids[b] [1, n_b], target_hidden[b] [1, n_b, 3H]) in
        one packed forward (`forward_packed`)."""
        for ids, hidden in zip(token_ids, target_hidden):
            if ids.dim() != 2 or ids.shape[0] != 1 or hidden.shape[:2] != ids.shape:
                raise ValueError(f"extend expects token_ids [1, n] and target_hidden [1, n, 3H], got "
                                 f"{tuple(ids.shape)} and {tuple(hidden.shape)}")
        items = [(c, ids, hidden) for c, ids, hidden in zip(caches, token_ids, target_hidden) if ids.shape[1]]
        if len(items) <= 1:
            for c, ids, hidden in items:
                self.extend(c, ids, hidden)
            return
        a, w = self.midlayer.self_attn, self.lm_head.weight
        segments = [PackedSegment(c.reserve(c.num_tokens + ids.shape[1], a.num_kv_heads, a.head_dim, w.dtype, w.device),
                                  c.num_tokens, ids.shape[1]) for c, ids, _ in items]
        positions = torch.cat([torch.arange(seg.start, seg.start + seg.length, device=w.device) for seg in segments])
        out = self.forward_packed(torch.cat([hidden.to(w.device) for _, _, hidden in items], dim=1),
                                  torch.cat([ids.to(w.device) for _, ids, _ in items], dim=1), positions[None], segments)
        end = 0
        for (c, _, _), seg in zip(items, segments):
            end += seg.length
            c.num_tokens = seg.start + seg.length
            c.last_logits, c.last_hidden = out.logits[:, end - 1], out.hidden[:, end - 1]

    def copy_prefix(self, dst: Eagle3Cache, src: Eagle3Cache, length: int) -> None:
        """Give the empty cache `dst` the first `length` committed positions of `src` (K/V copied; the
        last-position outputs come with the next `extend`)."""
        if dst.num_tokens:
            raise ValueError("copy_prefix fills an empty drafter cache")
        if not 0 < length <= src.num_tokens:
            raise ValueError(f"copy_prefix of {length} positions from a drafter cache holding {src.num_tokens}")
        a = self.midlayer.self_attn
        kv = dst.reserve(length, a.num_kv_heads, a.head_dim, src.kv.dtype, src.kv.device)
        kv[:, :, :, :length] = src.kv[:, :, :, :length]
        dst.num_tokens = length

    def prefill(self, cache: Eagle3Cache, input_ids: torch.Tensor, target_hidden: torch.Tensor, next_token: int) -> None:
        """After the target prefilled input_ids [1, T] (hidden [1, T, 3H]) and `next_token` (the
        root) was chosen: drafter positions 0..T-1 get tokens x_1..x_{T-1}, next_token."""
        shifted = torch.cat([input_ids[:, 1:], input_ids.new_tensor([[int(next_token)]])], dim=1)
        self.extend(cache, shifted, target_hidden)

    def commit(self, cache: Eagle3Cache, accepted_pos: torch.Tensor, emitted_ids: torch.Tensor,
               target_hidden: torch.Tensor) -> None:
        """After a verify step: accepted layout positions accepted_pos [D] (-1 pad), the emitted
        tokens emitted_ids [D+1] (accepted tokens then the bonus, -1 pad) and the verify forward's
        capture hidden [1, 1+K, 3H]. Appends (emitted token i, hidden at root/accepted node i)."""
        self.extend(cache, *self.commit_pairs(accepted_pos, emitted_ids, target_hidden))

    def commit_pairs(self, accepted_pos: torch.Tensor, emitted_ids: torch.Tensor,
                     target_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What `commit` appends: (token ids [1, n], target hidden [1, n, 3H]), n = accepted + 1."""
        if accepted_pos.device.type == "cpu" and emitted_ids.device.type == "cpu":
            # a handful of indices: filtering them in numpy is a few us instead of ~10 torch ops
            accepted, emitted = accepted_pos.reshape(-1).numpy(), emitted_ids.reshape(-1).numpy()
            accepted, emitted = accepted[accepted >= 0], emitted[emitted >= 0]
            pos = torch.from_numpy(np.concatenate([np.zeros(1, dtype=np.int64), accepted.astype(np.int64)]))
            emitted = torch.from_numpy(emitted.astype(np.int64))
        else:
            accepted = accepted_pos.reshape(-1)
            accepted = accepted[accepted >= 0]
            emitted = emitted_ids.reshape(-1)
            emitted = emitted[emitted >= 0]
            pos = torch.cat([accepted.new_zeros(1), accepted]).long()
        if emitted.shape[0] != accepted.shape[0] + 1:
            raise ValueError(f"{emitted.shape[0]} emitted tokens for {accepted.shape[0]} accepted nodes; "
                             "expected accepted + 1 (the bonus token)")
        return emitted[None].to(self.lm_head.weight.device), target_hidden.index_select(1, pos.to(target_hidden.device))

    def draft_tree(self, cache: Eagle3Cache, steps: int, topk: int, ddd_threshold: float | None = None,
                   should_expand=None, constraint=None, sync_free: bool | None = None):
        """Draft a tree after the committed positions (see drafting.py); returns Eagle3Draft.
        `should_expand(tree, frontier)` -> False stops drafting before the next expansion; `constraint`
        restricts each node's children to the tokens a grammar allows; `sync_free` (None: off the CPU)
        feeds padded frontiers instead of reading their length back."""
        from .drafting import draft_eagle3_tree

        return draft_eagle3_tree(self, cache, steps, topk, ddd_threshold, should_expand, constraint=constraint,
                                 sync_free=sync_free)

