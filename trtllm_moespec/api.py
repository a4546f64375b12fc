"""The public Python API: `LLM(...).generate(...)`, `SamplingParams`, `TreeConfig`.

    from trtllm_moespec import LLM, SamplingParams, TreeConfig
    llm = LLM(model="moespec-tiny", policy="joint")
    out = llm.generate(["def fib(n):"], SamplingParams(max_tokens=64))[0]
    print(out.text, out.stats.summary())

Everything a policy needs (drafter, cost profile, expert predictor) is resolved and
checked here, before any long work, with errors that say how to fix the problem.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from .assets import DEFAULT_MODEL
from .core.cost import CostTable
from .core.logprobs import MAX_LOGPROBS, TokenLogprob
from .core.logit_rules import LogitRules, TokenHistory
from .core.policies import POLICIES, SelectionPolicy, make_policy
from .core.values import VALUE_KINDS
from .core.sampling import SamplingConfig
from .detokenize import TextStream, cut_text, stop_string_check
from .engine.config import TreeConfig
from .engine.engine import Request, SpecEngine
from .engine.stats import GenerationStats, StepStats
from .engine.structured import GrammarCompiler, StructuredOutput
from .models.checkpoint import parse_dtype
from .resolve import (TINY, ModelPaths, check_target_dir, check_tree_fits_drafter, device_name, load_cost_profile,
                      load_predictor, load_value_model, parse_device, resolve_model, set_cpu_threads)

if TYPE_CHECKING:
    from .models.target import TargetModel

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamEvent", "TreeConfig"]

METHODS = tuple(sorted(set(POLICIES) | {"ddd"}))
COST_AWARE = ("evict", "ecospec", "joint", "coverage", "ddd")  # policies that get the drafting rules by default
GUARD_MODES = ("auto", "measured", "profiled", "off")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample (validated on construction)."""

    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request generator seed; None = nondeterministic
    # Stop strings: the output's tokens end with the one that completed a stop string, its text where the
    # stop string begins (OpenAI's and vLLM's rule), or where it ends with include_stop_str_in_output.
    stop: tuple[str, ...] | str | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # the text leaves out special tokens (eos, chat markers); False keeps them
    # Report each output token's logprob under the target (raw logits: before temperature, top-k and top-p)
    # and this many most likely alternatives (0: none); None: off. RequestOutput.logprobs holds them.
    logprobs: int | None = None
    # The same for every prompt token after the first (RequestOutput.prompt_logprobs): the prefill keeps
    # every position's logits (a [L, V] block) and reuses no cached prefix.
    prompt_logprobs: int | None = None
    # Logit rules (core/logit_rules.py), each position of a tree under its own context: OpenAI's presence /
    # frequency penalties ([-2, 2], on the output's tokens), vLLM's / transformers' repetition penalty (> 0,
    # 1 = off; on the prompt's and the output's tokens), OpenAI's logit_bias ({token id: [-100, 100]}), and
    # vLLM's min_tokens (eos and stop_token_ids are not drawn before the output holds this many).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] | None = None  # more tokens that end the output (kept), also with ignore_eos
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: only these tokens may be drawn (None: all)
    bad_words: tuple[str, ...] | None = None  # vLLM's: words never completed (as tokenized alone and after a space)
    min_p: float = 0.0  # keep tokens with probability >= min_p * the most likely one's (after top-k); 0 = off
    # The output must match this (JSON, a JSON schema, a regex, a choice, an EBNF grammar; engine/structured.py):
    # e.g. StructuredOutput.of(json_schema={...}). Needs xgrammar and ends at the model's eos.
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not (_is_int(n) and 0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {n!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**64):
            # torch.Generator.manual_seed takes 64 bits; a larger seed used to fail only after the model loaded
            raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop and any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.logit_bias, dict):  # a hashable, ordered form (and the dict's keys checked as ints)
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items(), key=lambda kv: str(kv[0]))))
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput (StructuredOutput.of(...)), got "
                             f"{type(self.structured).__name__}")
        if self.structured is not None and (self.ignore_eos or self.min_tokens):
            # a complete grammar allows only eos, which these would forbid: nothing could be drawn
            raise ValueError("structured output ends at the model's eos: it cannot be used with ignore_eos or "
                             "min_tokens")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes)) or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be a list of token ids >= 0, got {ids!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(ids))) or None)
            if self.structured is not None:  # each restricts the tokens: a grammar's next one might not be allowed
                raise ValueError("allowed_token_ids cannot be combined with structured output")
        if self.bad_words is not None:
            words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
            if not all(isinstance(w, str) and w.strip() for w in words):
                raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}")
            object.__setattr__(self, "bad_words", words or None)
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
            if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
                raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        for name in ("temperature", "top_p"):
            if not isinstance(getattr(self, name), (int, float)) or isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        self.config()  # validates the ranges of temperature / top_k / top_p / min_p
        self.logit_rules()

    def logit_rules(self) -> LogitRules:
        return LogitRules(self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
                          tuple(self.logit_bias or ()), self.min_tokens, self.allowed_token_ids or ())

    def config(self) -> SamplingConfig:
        if not isinstance(self.min_p, (int, float)) or isinstance(self.min_p, bool):
            raise ValueError(f"min_p must be a number, got {self.min_p!r}")
        return SamplingConfig(temperature=float(self.temperature), top_k=int(self.top_k), top_p=float(self.top_p),
                              min_p=float(self.min_p))


def _is_int(x) -> bool:
    """An int that is not a bool (True would silently mean 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str  # "" when the model has no tokenizer
    finish_reason: str  # "length" | "stop"
    stats: GenerationStats
    steps: tuple[StepStats, ...] = ()  # per-iteration records
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token of token_ids when SamplingParams.logprobs is set
    # one per prompt token when SamplingParams.prompt_logprobs is set; None first (the first token has no context)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    @staticmethod
    def of(request: Request, text: str) -> "RequestOutput":
        """The output of a finished engine request whose text (a stop string's cut applied) is `text`."""
        return RequestOutput(list(request.prompt_ids), list(request.output_ids), text, request.finish_reason or "length",
                             request.stats(), tuple(request.steps),
                             None if request.logprobs is None else tuple(request.output_logprobs),
                             None if request.prompt_logprobs is None else (None, *request.prompt_token_logprobs))


@dataclass(frozen=True)
class StreamEvent:
    """One streamed chunk; `output` is set on the last event only, which may carry text too (an incomplete
    UTF-8 character is held back until its bytes arrive). Joined, the events' texts equal the output's text."""

    token_ids: list[int]
    text: str
    output: RequestOutput | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # of token_ids, when SamplingParams.logprobs is set


class LLM:
    """A target MoE model with a drafter and a selection policy."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        draft_model: str | None = None,
        policy: str = "joint",
        tree: TreeConfig = TreeConfig(),
        device: str = "cpu",
        dtype: str = "float32",
        cost_profile: str | Path | CostTable | None = None,
        predictor: str | Path | None = None,
        drafter: str = "eagle3",
        policy_options: dict | None = None,
        ddd_threshold: float | None = None,
        override_profile: bool = False,
        guard: str = "auto",
        draft_stop: bool | None = None,
        ep=None,
        ep_pricing: bool = True,
        model_impl: str = "lean",
        values: str = "calibrated",
        threads: int | None = 1,
        cuda_graphs: bool | None = None,
        prefix_cache: int = 0,
        target_model: TargetModel | None = None,
    ):
        """ep: an `parallel.run.EPContext` on rank 0 of an `mpirun -n N ... --ep N` job (None: one process);
        ep_pricing: with ep, ecospec / joint price U_max, each MoE layer's busiest rank (see core/placement.py);
        cuda_graphs: replay the verify forward (plain steps included) from one CUDA graph per verify-length
        bucket (models/cuda_graphs.py); None = on for CUDA with model_impl='lean', off otherwise;
        prefix_cache: keep the K/V of up to this many finished prompts, for later prompts that begin with
        the same tokens (engine/prefix_cache.py; 0 = off). Each kept prompt holds one KV-cache slot;
        target_model: the target of another LLM of the same model, device, dtype and model_impl, whose loaded
        weights (and static KV cache) this one shares instead of loading its own copy. For comparing
        policies on one copy of the weights (the benchmark does): where each loads its own, the copies'
        placement in memory alone moved a plain step's time by a few percent. Requests of LLMs that share a
        target must not run at the same time."""
        if policy not in METHODS:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(METHODS)}")
        if drafter not in ("eagle3", "ngram"):
            raise ValueError(f"drafter must be 'eagle3' or 'ngram', got {drafter!r}")
        if not isinstance(tree, TreeConfig):
            raise ValueError(f"tree must be a TreeConfig, got {type(tree).__name__}")
        if guard not in GUARD_MODES:
            raise ValueError(f"guard must be one of {', '.join(GUARD_MODES)}, got {guard!r}")
        if draft_stop not in (None, True, False):
            raise ValueError(f"draft_stop must be None (auto), True or False, got {draft_stop!r}")
        if values not in VALUE_KINDS:
            raise ValueError(f"unknown values {values!r}; choose one of {', '.join(VALUE_KINDS)}")
        if cuda_graphs not in (None, True, False):
            raise ValueError(f"cuda_graphs must be None (auto), True or False, got {cuda_graphs!r}")
        if not _is_int(prefix_cache) or prefix_cache < 0:
            raise ValueError(f"prefix_cache must be an integer >= 0 (kept prompts; 0 = off), got {prefix_cache!r}")
        if prefix_cache and (model_impl != "lean" or ep is not None):
            raise ValueError("prefix_cache needs model_impl='lean' and one process (its K/V copy runs on this "
                             "process's cache only)")
        _check_argument_types(model=model, draft_model=draft_model, cost_profile=cost_profile, predictor=predictor,
                              ddd_threshold=ddd_threshold, policy_options=policy_options)
        self.policy_name, self.tree, self.device, self.dtype = policy, tree, parse_device(device), dtype
        parse_dtype(dtype)
        set_cpu_threads(threads, self.device)
        self.cuda_graphs = _resolve_cuda_graphs(cuda_graphs, self.device, model_impl, ep)
        # Cheap checks first, the model before anything derived from it: a bad checkpoint directory, a
        # missing profile or drafter, or a tree the drafter cannot draft fails before any weights load.
        self.paths: ModelPaths = resolve_model(str(model), draft_model, predictor)
        check_target_dir(self.paths.target)
        if values == "head" and self.paths.acceptance_head is None:
            raise ValueError(f"values='head' needs a learned acceptance head; {self.paths.model_id} ships none "
                             "(use values='calibrated')")
        self.values_name = values
        if policy == "joint" and drafter == "eagle3" and self.paths.predictor_head is not None:
            # Ours reads routing off the drafter's hidden state: no extra forward per step.
            self.paths = replace(self.paths, predictor=self.paths.predictor_head)
        needs = POLICIES.get(policy, POLICIES["eagle3"])
        if needs.drafts and drafter == "eagle3" and self.paths.draft is not None:
            check_tree_fits_drafter(tree, self.paths.draft)
        if needs.drafts and drafter == "eagle3" and self.paths.draft is None:
            raise ValueError(f"policy {policy!r} drafts with EAGLE-3 but no draft model was given: pass "
                             "draft_model=DIR (SpecForge format) or drafter='ngram'")
        if needs.needs_experts and self.paths.predictor is None and predictor != "oracle":
            raise ValueError(f"policy {policy!r} needs an expert predictor: pass predictor=DIR, or predictor='oracle' "
                             "(analysis only: a target forward per step)")
        profile = load_cost_profile(policy, cost_profile, self.paths, device_name(self.device), dtype, tree,
                                    override_profile)

        rules_profile = profile if profile is not None else _optional_profile(policy, self.paths, self.device, dtype,
                                                                              tree, override_profile)
        guard_obj = _build_guard(policy, guard, rules_profile)
        stop_rule = _build_stop_rule(policy, draft_stop, rules_profile, tree)

        from .engine.drafters import Eagle3Source, NgramSource
        from .models.target import TargetModel

        self.target = (TargetModel.load(self.paths.target, device=self.device, dtype=dtype, model_impl=model_impl)
                       if target_model is None else _shared_target(target_model, self.paths.target, self.device,
                                                                   dtype, model_impl))
        placement = None
        if ep is not None:  # shard this rank's experts; every forward then runs on all ranks
            self.target = ep.leader_target(self.target, self.paths.target, dtype, model_impl)
            placement = ep.placement
        if self.cuda_graphs:  # captured lazily, one bucket at a time, on first use
            from .models.cuda_graphs import verify_buckets

            self.target.use_verify_runner("graphs", verify_buckets(tree.max_draft_tokens))
        self.tokenizer = _load_tokenizer(self.paths.target)
        self._grammar_compiler: GrammarCompiler | None = None
        options = dict(policy_options or {})
        if placement is not None and ep_pricing and policy in ("ecospec", "joint"):
            options.setdefault("placement", placement)
        self.policy: SelectionPolicy = _build_policy(policy, tree, profile, options)
        source, eagle3 = None, None
        if needs.drafts and drafter == "eagle3":
            from .models.eagle3 import load_eagle3

            eagle3 = load_eagle3(self.paths.draft, target=self.target)
            source = Eagle3Source(eagle3, tree.steps, tree.topk,
                                  ddd_threshold if ddd_threshold is not None else (0.3 if policy == "ddd" else None),
                                  stop_rule)
            if self.cuda_graphs:  # a step commits at most steps + 1 tokens (the accepted path and the bonus)
                from .models.cuda_graphs import verify_buckets
                from .models.eagle3.graphs import make_drafter_runner, make_frontier_runner

                source.extend_runner = make_drafter_runner("graphs", eagle3, verify_buckets(tree.steps))
                source.frontier_runner = make_frontier_runner("graphs", eagle3, tree.topk)  # frontier <= topk
        elif needs.drafts:
            from .models.ngram import NgramConfig, NgramDrafter

            source = NgramSource(NgramDrafter(NgramConfig(max_nodes=max(tree.num_tree_nodes, 1))))
        predictor_obj = (load_predictor(predictor, self.paths, self.target, eagle3)
                         if self.policy.needs_experts else None)
        value_model = load_value_model(values, self.paths, self.target) if self.policy.uses_values else None
        from .engine.prefix_cache import PrefixCache

        self.engine = SpecEngine(self.target, self.policy, tree, source, predictor_obj, _device_selector(self.device),
                                 value_model, placement=placement, guard=guard_obj,
                                 prefix_cache=PrefixCache(self.target, prefix_cache) if prefix_cache else None)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params: SamplingParams | None = None, use_tqdm: bool = False,
                 max_batch_size: int = 16) -> list[RequestOutput]:
        """Generate for each prompt (str or token-id list). Several prompts are decoded together, up to
        `max_batch_size` at once, one target forward per step for all of them (engine/batch.py:
        continuous batching; each greedy output is the one decoding it alone gives, sampling keeps its
        distribution). `max_batch_size=1`, an expert-parallel engine or an analysis-only policy
        decodes them one at a time."""
        if not _is_int(max_batch_size) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        params = sampling_params or SamplingParams()
        batch = self.encode(prompts)
        if len(batch) > 1 and max_batch_size > 1 and self.batchable:
            return self._generate_batched(batch, params, max_batch_size, use_tqdm)
        outputs = []
        for ids in tqdm(batch, desc="generate", disable=not use_tqdm):
            events = list(self._events(ids, params))
            outputs.append(events[-1].output)
        return outputs

    @property
    def batchable(self) -> bool:
        """Can requests share engine steps (engine/batch.py)? Not under expert parallelism (one request
        at a time across the ranks) nor for an analysis policy that needs the target's scores per request."""
        return self.engine.placement is None and not self.engine.policy.needs_target

    def _generate_batched(self, batch: list[list[int]], params: SamplingParams, max_batch_size: int,
                          use_tqdm: bool) -> list[RequestOutput]:
        from .engine.batch import BatchedEngine

        requests = [self.make_request(ids, params) for ids in batch]
        engine = BatchedEngine(self.engine, min(max_batch_size, len(requests)))
        with tqdm(total=len(requests), desc="generate", disable=not use_tqdm) as bar:
            engine.run_all(requests, on_finish=lambda _: bar.update(1))
        decode = self.decoder(params.skip_special_tokens)
        return [RequestOutput.of(r, cut_text(decode(r.output_ids), r.stop_trim)) for r in requests]

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamEvent]:
        """Yield text as tokens are committed; the last event carries the RequestOutput."""
        batch = self.encode([prompt] if isinstance(prompt, str) or _is_ids(prompt) else prompt)
        if len(batch) != 1:
            raise ValueError("stream() takes one prompt")
        yield from self._events(batch[0], sampling_params or SamplingParams())

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None
             ) -> RequestOutput | list[RequestOutput]:
        """Apply the chat template (`chat_template`, a Jinja string, else the tokenizer's; with
        `chat_template_kwargs`, e.g. Qwen3's enable_thinking), then generate. A list of conversations
        is decoded together, as `generate` decodes several prompts, and gives a list of outputs."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.paths.target} has no tokenizer; pass token ids to generate()")
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError(f"model {self.paths.target} has no chat template (moespec-tiny is not chat-tuned): "
                             "pass chat_template=..., or use generate() with plain prompts")
        several = isinstance(messages, (list, tuple)) and bool(messages) and all(
            isinstance(c, (list, tuple)) for c in messages)
        conversations = list(messages) if several else [messages]
        for conversation in conversations:
            if (not isinstance(conversation, (list, tuple)) or not conversation
                    or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in conversation)):
                raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts (or a "
                                 f"list of such conversations), got {_describe(conversation)}")
        prompts = []
        for conversation in conversations:
            ids = self.tokenizer.apply_chat_template(list(conversation), chat_template=template,
                                                     add_generation_prompt=True, tokenize=True,
                                                     **(chat_template_kwargs or {}))
            prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
        outputs = self.generate(prompts, sampling_params)
        return outputs if several else outputs[0]

    # ------------------------------------------------------------------ helpers
    def _events(self, ids: list[int], params: SamplingParams) -> Iterator[StreamEvent]:
        request = self.make_request(ids, params)
        text = TextStream(self.decoder(params.skip_special_tokens), params.stop)
        for new in self.engine.run(request):
            n = len(request.output_ids)  # the step's tokens are final: its stop strings were applied
            logprobs = () if request.logprobs is None else tuple(request.output_logprobs[n - len(new):n])
            yield StreamEvent(list(new), text.push(request.output_ids, request.stop_trim), logprobs=logprobs)
        rest = text.finish(request.output_ids, request.stop_trim)
        yield StreamEvent([], rest, RequestOutput.of(request, text.sent))

    def make_request(self, ids: list[int], params: SamplingParams) -> Request:
        """A checked engine request (for tools that drive `llm.engine.run` step by step)."""
        limit = self.target.max_position_embeddings
        if len(ids) + params.max_tokens > limit:
            raise ValueError(f"prompt of {len(ids)} tokens plus max_tokens={params.max_tokens} exceeds the model's "
                             f"context of {limit} tokens")
        if min(ids) < 0 or max(ids) >= self.target.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.target.vocab_size})")
        generator = torch.Generator(device="cpu").manual_seed(params.seed) if params.seed is not None else None
        stop_ids = frozenset() if params.ignore_eos else frozenset(self.target.eos_token_ids)
        stop_ids = stop_ids | frozenset(params.stop_token_ids or ())
        rules = params.logit_rules()
        if params.bad_words:
            rules = replace(rules, bad_words=self.bad_word_ids(params.bad_words))
        history = TokenHistory(rules, ids, self.target.vocab_size, stop_ids, self.target.device) if rules.active else None
        grammar = None
        if params.structured is not None:
            grammar = self._grammars().matcher(params.structured)
        return Request(ids, params.config(), params.max_tokens, generator, stop_ids, self._stop_check(params),
                       logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs, history=history,
                       grammar=grammar)

    def bad_word_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as token sequences: each word tokenized alone and after a space (at the start
        of the text and inside it BPE tokenizes a word differently), distinct sequences once each."""
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this model has none")
        variants = (self.tokenizer.encode(prefix + w.lstrip(), add_special_tokens=False)
                    for w in words for prefix in ("", " "))
        return tuple(dict.fromkeys(tuple(ids) for ids in variants if ids))

    def _grammars(self) -> GrammarCompiler:
        """The model's grammar compiler, made on first use (it reads the whole vocabulary)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.target.vocab_size,
                                                     frozenset(self.target.eos_token_ids))
        return self._grammar_compiler

    def _stop_check(self, params: SamplingParams):
        if not params.stop:
            return None
        if self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        return stop_string_check(self.decoder(params.skip_special_tokens), params.stop, params.include_stop_str_in_output)

    def encode(self, prompts, add_special_tokens: bool = False) -> list[list[int]]:
        """Prompts (str or token ids, one or many) -> checked token-id lists (`add_special_tokens`: the
        tokenizer's own, e.g. a BOS, around text prompts; Qwen3 and GPT-OSS tokenizers add none)."""
        if isinstance(prompts, str) or _is_ids(prompts):
            prompts = [prompts]
        batch = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("this model has no tokenizer: pass prompts as token-id lists")
                p = self.tokenizer.encode(p, add_special_tokens=add_special_tokens)
            elif not isinstance(p, (list, tuple)) or not all(_is_int(t) for t in p):
                # int(1.7) == 1 would silently change the prompt
                raise ValueError(f"a prompt must be a string or a list of int token ids, got {_describe(p)}")
            p = [int(t) for t in p]
            if not p:
                raise ValueError("empty prompt: give at least one token")
            batch.append(p)
        if not batch:
            raise ValueError("no prompts given")
        return batch

    def decoder(self, skip_special_tokens: bool = True) -> Callable[[Sequence[int]], str]:
        """Token ids -> text, leaving out the special tokens or keeping them ("" without a tokenizer)."""
        return self._decode if skip_special_tokens else self._decode_raw

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer is not None else ""

    def _decode_raw(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False) if self.tokenizer is not None else ""


def _shared_target(target, path: Path, device: torch.device, dtype: str, model_impl: str):
    """`target_model=`: another LLM's target, once it is the one this LLM would load."""
    from .models.target import TargetModel

    if not isinstance(target, TargetModel):
        raise ValueError(f"target_model must be another LLM's .target, got {type(target).__name__}")
    loaded = Path(getattr(target.model.config, "_name_or_path", "") or "")
    have = {"path": loaded.resolve(), "device": target.device, "dtype": target.dtype, "model_impl": target.model_impl}
    wanted = {"path": path.resolve(), "device": device, "dtype": parse_dtype(dtype), "model_impl": model_impl}
    differ = [f"{k} {have[k]} (this LLM: {wanted[k]})" for k in have if have[k] != wanted[k]]
    if differ:
        raise ValueError(f"target_model is not the target this LLM would load: its {', '.join(differ)}")
    return target


def _check_argument_types(*, model, draft_model, cost_profile, predictor, ddd_threshold, policy_options) -> None:
    """A wrong type fails here with the argument's name, not as a TypeError deep inside pathlib or a policy."""
    paths = {"model": model, "draft_model": draft_model, "cost_profile": cost_profile, "predictor": predictor}
    for name, value in paths.items():
        allowed = (str, Path, CostTable) if name == "cost_profile" else (str, Path)
        if not isinstance(value, allowed) and not (value is None and name != "model"):
            kinds = "a path" + (", 'roofline:<device>' or a CostTable" if name == "cost_profile" else "")
            kinds += f" or '{TINY}'" if name == "model" else " or None"
            raise ValueError(f"{name} must be {kinds}, got {_describe(value)}")
    if ddd_threshold is not None and (not isinstance(ddd_threshold, (int, float)) or isinstance(ddd_threshold, bool)):
        raise ValueError(f"ddd_threshold must be a number or None, got {_describe(ddd_threshold)}")
    if policy_options is not None and not isinstance(policy_options, dict):
        raise ValueError(f"policy_options must be a dict or None, got {_describe(policy_options)}")


def _is_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) for t in x)


def _describe(x) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _load_tokenizer(path: Path):
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


def _build_policy(name: str, tree: TreeConfig, profile: CostTable | None, options: dict) -> SelectionPolicy:
    """Policy with defaults derived from the tree config and the cost profile."""
    opts = dict(options)
    if name in ("eagle3", "ddd", "coverage", "joint", "evict"):
        opts.setdefault("budget", tree.max_draft_tokens)
    if name == "evict" or (name == "oracle" and profile is not None):
        opts.setdefault("cost_table", profile)
    if name == "joint":
        if profile is None or profile.expert_model is None:
            raise ValueError("policy 'joint' needs a cost profile with an expert cost fit; run `moespec profile`")
        opts.setdefault("cost_model", profile.expert_model)
    return make_policy("eagle3" if name == "ddd" else name, **opts)


def _optional_profile(policy: str, paths: ModelPaths, device: torch.device, dtype: str, tree: TreeConfig,
                      override: bool) -> CostTable | None:
    """The model's own profile for the drafting rules of a cost-aware policy that does not need one
    (ecospec, coverage, ddd): used when present and valid for this setting, else those rules fall back
    (the guard then measures both step kinds itself; drafting is not cut)."""
    if policy not in COST_AWARE or not paths.cost_profile.is_file():
        return None
    try:
        return CostTable.load(paths.cost_profile, model_id=paths.model_id, device=device_name(device), dtype=dtype,
                              tree=tree.as_tuple(), override=override)
    except ValueError:
        return None


def _build_guard(policy: str, mode: str, profile: CostTable | None):
    """The speculate-or-not rule: `auto` = the measured goodput guard for cost-aware policies, off otherwise;
    `measured`; `profiled` (k = 0 before drafting on the profiled costs only); `off`."""
    from .engine.guard import Guard, GuardConfig

    if mode == "auto":
        mode = "measured" if policy in COST_AWARE else "off"
    if mode == "off" or policy == "ar":
        return None
    table = profile.costs if profile is not None else None
    plain = profile.plain_step if profile is not None else None
    if mode == "profiled" and plain is None:
        raise ValueError("guard='profiled' needs a cost profile with a plain-step cost; re-profile with `moespec profile`")
    return Guard(GuardConfig(measured=mode == "measured"), table, plain)


def _build_stop_rule(policy: str, draft_stop: bool | None, profile: CostTable | None, tree: TreeConfig):
    """Stop drafting when another drafter forward cannot pay (core.drafting); on by default for the
    cost-aware policies when the profile has the cost of one drafter forward."""
    from .core.drafting import DraftStopRule

    wanted = (policy in COST_AWARE and policy != "ddd") if draft_stop is None else draft_stop
    if not wanted:
        return None
    if profile is None or profile.draft_forward is None:
        if draft_stop:
            raise ValueError("draft_stop=True needs a cost profile with the cost of one drafter forward; "
                             "re-profile with `moespec profile`")
        return None
    return DraftStopRule(profile.costs, profile.draft_forward, tree.steps)


def _resolve_cuda_graphs(requested: bool | None, device: torch.device, model_impl: str, ep) -> bool:
    """Whether the verify forward replays CUDA graphs: on by default for CUDA + lean (the graphs
    capture the lean static-shape forward), never elsewhere; asking for them where they cannot run
    is an error rather than a silent eager run."""
    possible = device.type == "cuda" and model_impl == "lean" and ep is None
    if requested and not possible:
        why = ("the target is on " + str(device)) if device.type != "cuda" else (
            "model_impl='hf' runs transformers' forward" if model_impl != "lean" else "expert parallelism is on")
        raise ValueError(f"cuda_graphs=True needs a CUDA device, model_impl='lean' and no --ep; {why}")
    return possible if requested is None else requested


def _device_selector(device: torch.device):
    """On CUDA, selection runs as the moespec::select_tree device op (no host sync inside)."""
    if device.type != "cuda":
        return None
    from .kernels.select_policy import select_on_device

    return select_on_device
