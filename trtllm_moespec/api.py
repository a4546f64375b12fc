"""The public Python API: `LLM`, `SamplingParams`, `MoESpecConfig`, `RequestOutput`, `StreamEvent`.

    from trtllm_moespec import LLM, MoESpecConfig, SamplingParams, TreeConfig
    llm = LLM("moespec-tiny", speculative_config=MoESpecConfig(policy="joint", tree=TreeConfig(4, 8, 32)))
    out = llm.generate(["def fib(n):"], SamplingParams(max_tokens=64))[0]
    print(out.outputs[0].text, out.stats.summary())

`LLM(...)` reads top to bottom once: the user's arguments become a frozen, fully resolved
configuration (`resolve.resolve_config`: every default decided, every file checked, before any
weights load), then the target, the tokenizer and the engine are built from it (`assemble.py`).
The speculative keywords may be given flat (`LLM(model, policy="evict", tree=...)`) or as one
`speculative_config=MoESpecConfig(...)`, the shape of TensorRT-LLM's LLM API.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from .assemble import assemble_engine, load_target, load_tokenizer
from .assets import DEFAULT_MODEL
from .config import (COST_AWARE, GUARD_MODES, METHODS, SPEC_FIELDS, MoESpecConfig, ResolvedConfig, RuntimeConfig,
                     describe as _describe, is_int as _is_int)
from .core.cost import CostTable
from .core.logit_rules import TokenHistory
from .detokenize import TextStream, cut_text, stop_string_check
from .engine.config import TreeConfig
from .engine.engine import Request, SpecEngine
from .engine.structured import GrammarCompiler, StructuredOutput
from .outputs import CompletionOutput, RequestOutput, StreamEvent
from .resolve import ModelPaths, resolve_config, set_cpu_threads
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .core.policies import SelectionPolicy
    from .models.target import TargetModel

__all__ = ["LLM", "CompletionOutput", "MoESpecConfig", "RequestOutput", "SamplingParams", "StreamEvent",
           "StructuredOutput", "TreeConfig", "METHODS", "COST_AWARE", "GUARD_MODES"]


class LLM:
    """A target MoE model with a drafter and a selection policy."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        draft_model: str | None = None,
        policy: str = "joint",
        tree: TreeConfig | None = None,
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
        values: str | None = None,
        threads: int | None = 1,
        cuda_graphs: bool | None = None,
        prefix_cache: int = 0,
        target_model: TargetModel | None = None,
        speculative_config: MoESpecConfig | None = None,
    ):
        """The speculative keywords (draft_model, policy, tree, cost_profile, predictor, drafter,
        policy_options, ddd_threshold, override_profile, guard, draft_stop, ep_pricing, values) are the
        fields of `MoESpecConfig` (config.py, one comment per field); give them flat or as
        `speculative_config=`, not both. The others say where and how the target runs:
        ep: an `parallel.run.EPContext` on rank 0 of an `mpirun -n N ... --ep N` job (None: one process);
        cuda_graphs: replay the verify forward (plain steps included) from one CUDA graph per verify-length
        bucket (models/cuda_graphs.py); None = on for CUDA with model_impl='lean', off otherwise;
        prefix_cache: keep the K/V of up to this many finished prompts, for later prompts that begin with
        the same tokens (engine/prefix_cache.py; 0 = off). Each kept prompt holds one KV-cache slot;
        target_model: the target of another LLM of the same model, device, dtype and model_impl, whose loaded
        weights (and static KV cache) this one shares instead of loading its own copy. For comparing
        policies on one copy of the weights (the benchmark does): where each loads its own, the copies'
        placement in memory alone moved a plain step's time by a few percent. Requests of LLMs that share a
        target must not run at the same time."""
        flat = dict(draft_model=draft_model, policy=policy, tree=tree, cost_profile=cost_profile, predictor=predictor,
                    drafter=drafter, policy_options=policy_options, ddd_threshold=ddd_threshold,
                    override_profile=override_profile, guard=guard, draft_stop=draft_stop, ep_pricing=ep_pricing,
                    values=values)
        spec = _speculative_config(speculative_config, flat)
        runtime = RuntimeConfig(model=model, device=device, dtype=dtype, model_impl=model_impl, threads=threads,
                                cuda_graphs=cuda_graphs, prefix_cache=prefix_cache)
        self.config: ResolvedConfig = resolve_config(spec, runtime, ep)  # every check before any weights load
        set_cpu_threads(threads, self.config.device)
        self.tokenizer = load_tokenizer(self.config.paths.target)
        self.target, placement = load_target(self.config, target_model, ep)
        self.engine: SpecEngine = assemble_engine(self.config, self.target, placement)
        self.policy: SelectionPolicy = self.engine.policy  # kept: tools may swap the engine's (profiling does)
        self._grammar_compiler: GrammarCompiler | None = None

    # ------------------------------------------------------------------ the resolved configuration
    @property
    def paths(self) -> ModelPaths:
        return self.config.paths

    @property
    def policy_name(self) -> str:
        return self.config.policy

    @property
    def values_name(self) -> str:
        return self.config.spec.values

    @property
    def tree(self) -> TreeConfig:
        return self.config.tree

    @property
    def device(self) -> torch.device:
        return self.config.device

    @property
    def dtype(self) -> str:
        return self.config.dtype

    @property
    def cuda_graphs(self) -> bool:
        return self.config.cuda_graphs

    @property
    def speculative_config(self) -> MoESpecConfig:
        return self.config.spec

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, max_batch_size: int = 16) -> list[RequestOutput]:
        """Generate for each prompt (str or token-id list), one RequestOutput each with
        `SamplingParams.n` completions. `sampling_params`: one for every prompt, or a list of one per
        prompt (vLLM's form). Several requests are decoded together, up to `max_batch_size` at once,
        one target forward per step for all of them (engine/batch.py: continuous batching; each greedy
        output is the one decoding it alone gives, sampling keeps its distribution). `max_batch_size=1`,
        an expert-parallel engine or an analysis-only policy decodes them one at a time."""
        if not _is_int(max_batch_size) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        listed = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)
        batch = self.encode(listed)
        per_prompt = _params_per_prompt(sampling_params, len(batch))
        jobs = [(i, params) for i, p in enumerate(per_prompt) for params in p.completions()]  # one per completion
        if len(jobs) > 1 and max_batch_size > 1 and self.batchable:
            done = self._generate_batched([(batch[i], params) for i, params in jobs], max_batch_size, use_tqdm)
        else:
            done = [self._run_alone(batch[i], params) for i, params in tqdm(jobs, desc="generate",
                                                                             disable=not use_tqdm)]
        outputs = []
        for i, prompt in enumerate(listed):
            mine = [d for (j, _), d in zip(jobs, done) if j == i]
            outputs.append(RequestOutput.of_completions([r for r, _ in mine], [t for _, t in mine],
                                                        prompt if isinstance(prompt, str) else None))
        return outputs

    @property
    def batchable(self) -> bool:
        """Can requests share engine steps (engine/batch.py)? Not under expert parallelism (one request
        at a time across the ranks) nor for an analysis policy that needs the target's scores per request."""
        return self.engine.placement is None and not self.engine.policy.needs_target

    def _run_alone(self, ids: list[int], params: SamplingParams) -> tuple[Request, str]:
        """One request decoded alone: (the finished request, its text; a stop string's cut applied)."""
        request = self.make_request(ids, params)
        for _ in self.engine.run(request):
            pass
        return request, cut_text(self.decoder(params.skip_special_tokens)(request.output_ids), request.stop_trim)

    def _generate_batched(self, jobs: list[tuple[list[int], SamplingParams]], max_batch_size: int,
                          use_tqdm: bool) -> list[tuple[Request, str]]:
        from .engine.batch import BatchedEngine

        requests = [self.make_request(ids, params) for ids, params in jobs]
        engine = BatchedEngine(self.engine, min(max_batch_size, len(requests)))
        with tqdm(total=len(requests), desc="generate", disable=not use_tqdm) as bar:
            engine.run_all(requests, on_finish=lambda _: bar.update(1))
        return [(r, cut_text(self.decoder(p.skip_special_tokens)(r.output_ids), r.stop_trim))
                for r, (_, p) in zip(requests, jobs)]

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamEvent]:
        """Decode one prompt, yielding a `StreamEvent` per engine step: `event.text` is the new text
        (joined, the final text), `event.token_ids` the new tokens; the last event has `finished` set
        and carries the whole RequestOutput as `event.output` (outputs.py)."""
        batch = self.encode([prompt] if isinstance(prompt, str) or _is_ids(prompt) else prompt)
        if len(batch) != 1:
            raise ValueError("stream() takes one prompt")
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"stream() takes one SamplingParams, got {_describe(params)}")
        if params.n != 1:
            raise ValueError(f"stream() decodes one completion: n must be 1, got {params.n} (generate() gives n)")
        yield from self._events(batch[0], params, prompt if isinstance(prompt, str) else None)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the chat template (`chat_template`, a Jinja string, else the tokenizer's; with
        `chat_template_kwargs`, e.g. Qwen3's enable_thinking), then generate. Returns a list, as vLLM's
        `LLM.chat` does: one RequestOutput for one conversation, one per conversation for a list of
        them (decoded together, as `generate` decodes several prompts)."""
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
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ------------------------------------------------------------------ helpers
    def _events(self, ids: list[int], params: SamplingParams, prompt: str | None = None) -> Iterator[StreamEvent]:
        request = self.make_request(ids, params)
        text = TextStream(self.decoder(params.skip_special_tokens), params.stop)
        for new in self.engine.run(request):
            n = len(request.output_ids)  # the step's tokens are final: its stop strings were applied
            logprobs = () if request.logprobs is None else tuple(request.output_logprobs[n - len(new):n])
            yield StreamEvent(list(new), text.push(request.output_ids, request.stop_trim), logprobs=logprobs)
        rest = text.finish(request.output_ids, request.stop_trim)
        yield StreamEvent([], rest, RequestOutput.of(request, text.sent, prompt))

    def warm_up(self, tokens: int = 8, engine=None) -> float:
        """Pay the process's one-time costs now, not in the first request (`moespec serve` does before it
        serves): a greedy and a sampled request of `tokens` tokens through `engine` (default: this LLM's;
        or a batched or serving engine over it), every step speculative and no state left behind
        (`SpecEngine.warm_up`). Returns seconds."""
        ids = self.encode(["def warm_up(n):\n    return"])[0]
        params = [SamplingParams(max_tokens=tokens, ignore_eos=True),
                  SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=True)]
        return (engine or self.engine).warm_up([self.make_request(ids, p) for p in params])

    def make_request(self, ids: list[int], params: SamplingParams) -> Request:
        """A checked engine request (for tools that drive `llm.engine.run` step by step): one completion."""
        if params.n != 1:
            raise ValueError(f"an engine request is one completion: n must be 1, got {params.n} (generate() "
                             "makes the n requests of SamplingParams.completions())")
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


def _speculative_config(given: MoESpecConfig | None, flat: dict) -> MoESpecConfig:
    """The speculative configuration: `given`, or the flat keywords'. A flat keyword away from its default
    beside `given` is an error: one of the two would be silently ignored."""
    if given is None:
        return MoESpecConfig(**flat)
    if not isinstance(given, MoESpecConfig):
        raise ValueError(f"speculative_config must be a MoESpecConfig, got {_describe(given)}")
    default = MoESpecConfig()
    both = [name for name in SPEC_FIELDS if name in flat and not _same(flat[name], getattr(default, name))]
    if both:
        raise ValueError(f"{', '.join(both)} given both as keyword(s) and through speculative_config; pass each "
                         "in one place (MoESpecConfig holds all of them)")
    return given


def _same(a, b) -> bool:
    """a == b for plain values; identity for anything whose == is not a plain truth value."""
    try:
        return a is b or bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


def _params_per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: the same for all, or vLLM's list of one per prompt."""
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if isinstance(sampling_params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in sampling_params):
        if len(sampling_params) != num_prompts:
            raise ValueError(f"{len(sampling_params)} SamplingParams for {num_prompts} prompts: give one for all, "
                             "or one per prompt")
        return list(sampling_params)
    raise ValueError(f"sampling_params must be a SamplingParams or a list of them, one per prompt, got "
                     f"{_describe(sampling_params)}")


def _is_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) for t in x)
