"""Log-probabilities of emitted tokens (OpenAI's `logprobs`), from the verify forward's logits.

They are the target's raw distribution at each emitted token's position: log_softmax of the
target logits, before temperature, top-k and top-p (vLLM's default, `raw_logprobs`), so they
describe the model, not the sampling rule. In a speculative step, emitted token i was drawn from
the distribution at layout position `VerifyResult.keep_positions()[i]` (the root, then each
accepted node): the context there is exactly the one plain decoding has for that token, so every
policy reports the logprobs plain decoding would, up to the float rounding of a wider forward.

Prompt logprobs (`prompt_token_logprobs`, OpenAI's `echo` with `logprobs`, what evaluation harnesses
score continuations with) come from a prefill that keeps every position's logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .verify import VerifyResult

MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and the `n` most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the n most likely tokens, most likely first
    rank: int = 1  # 1 + how many tokens are more likely than this one (vLLM's `rank`)


def emitted_positions(result: VerifyResult) -> torch.Tensor:
    """[num_emitted] layout positions whose distributions the emitted tokens of request 0 were drawn from."""
    if result.accepted_pos.shape[1] == 0:  # a plain step: the root alone (one op, not four)
        return result.accepted_pos.new_zeros(1)
    return result.keep_positions()[0, : int(result.num_emitted[0])]


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """logits [P, V] at the positions token_ids [P] were drawn from -> each token's TokenLogprob."""
    if logits.shape[0] != len(token_ids):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(token_ids)} tokens")
    logp = torch.log_softmax(logits.float(), dim=-1)  # [P, V]
    ids = torch.tensor(token_ids, device=logp.device)
    chosen_logp = logp.gather(1, ids[:, None])  # [P, 1]
    chosen, ranks = chosen_logp[:, 0].tolist(), ((logp > chosen_logp).sum(-1) + 1).tolist()
    if top_n:
        values, indices = logp.topk(top_n, dim=-1)
        top = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        top = [()] * len(token_ids)
    return [TokenLogprob(t, c, k, r) for t, c, k, r in zip(token_ids, chosen, top, ranks)]


PROMPT_LOGPROBS_CHUNK = 512  # prompt positions per log_softmax: bounds the extra memory to a [512, V] block


def prompt_token_logprobs(logits: torch.Tensor, prompt_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """logits [L, V] of a prefill over prompt_ids [L] -> the TokenLogprob of prompt tokens 1..L-1 (token i
    under the distribution at position i - 1; the first token has no context and no entry)."""
    if logits.shape[0] != len(prompt_ids):
        raise ValueError(f"{logits.shape[0]} logit rows for a prompt of {len(prompt_ids)} tokens")
    out: list[TokenLogprob] = []
    for start in range(0, len(prompt_ids) - 1, PROMPT_LOGPROBS_CHUNK):
        end = min(start + PROMPT_LOGPROBS_CHUNK, len(prompt_ids) - 1)
        out += token_logprobs(logits[start:end], prompt_ids[start + 1:end + 1], top_n)
    return out
