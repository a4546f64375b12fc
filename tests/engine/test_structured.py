"""Structured output stays lossless: every policy's greedy output under a JSON schema, a regex or a
choice equals a plain reference loop (transformers' forward, xgrammar's mask at each step), alone
and batched; sampled tokens follow the masked distribution; xgrammar's tree traversal fills the
masks the by-hand reference does on the engine's own trees."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers

from tests.engine.distribution import assert_follows, draw, exact_first_tokens
from trtllm_moespec import LLM, SamplingParams, StructuredOutput, TreeConfig
from trtllm_moespec.engine.batch import BatchedEngine
from trtllm_moespec.engine.structured import GrammarState, unpack_bitmask

xgr = pytest.importorskip("xgrammar")

TINY_TARGET = "trtllm_moespec/assets/moespec-tiny/target"
PROMPT = "def add(a, b):\n"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "name": {"type": "string"}},
          "required": ["n", "name"]}
CONSTRAINTS = {"json_schema": StructuredOutput.of(json_schema=SCHEMA),
               "regex": StructuredOutput.of(regex=r"[0-9]{3}-[a-z]{2,6};"),
               "choice": StructuredOutput.of(choice=["yes", "no", "maybe not"])}


@pytest.fixture(scope="module")
def tiny():
    return {policy: LLM("moespec-tiny", policy=policy) for policy in ("ar", "eagle3", "joint")}


@torch.no_grad()
def reference_greedy(llm: LLM, prompt: list[int], output: StructuredOutput, n: int) -> list[int]:
    """Plain greedy decoding: transformers' forward over the whole context, the grammar's mask from a
    fresh xgrammar matcher, until the model's eos or n tokens."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32)
    matcher = xgr.GrammarMatcher(llm._grammars().compile(output))
    V, out = llm.target.vocab_size, []
    while len(out) < n and not (out and out[-1] in llm.target.eos_token_ids):
        logits = hf(torch.tensor([prompt + out])).logits[0, -1]
        bitmask = xgr.allocate_token_bitmask(1, V)
        matcher.fill_next_token_bitmask(bitmask)
        out.append(int(logits.masked_fill(~unpack_bitmask(bitmask, V)[0], -torch.inf).argmax()))
        assert matcher.accept_token(out[-1])
    return out


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
@pytest.mark.parametrize("policy", ["ar", "eagle3", "joint"])
def test_greedy_structured_output_equals_the_reference_loop(tiny, policy, kind, monkeypatch):
    """Also checks, on every tree the engine verifies, that xgrammar's traversal and the by-hand
    reference fill the same masks."""
    llm, output = tiny[policy], CONSTRAINTS[kind]
    compared = []
    fast = GrammarState.tree_masks

    def both(self, layout, row, T):
        masks = fast(self, layout, row, T)
        reference = self.tree_masks_reference(layout, row, T)
        # positions whose path the grammar allows (the others are never read: banned at an ancestor)
        reached = [True] + [False] * (T - 1)
        if T > 1:
            parents, tokens, valid = (layout.parent_pos[row].tolist(), layout.token_ids[row].tolist(),
                                      layout.valid[row].tolist())
            for p in range(1, T):  # parents come before their children
                q = parents[p]
                reached[p] = valid[p] and q >= 0 and reached[q] and bool(reference[q, tokens[p]])
        assert torch.equal(masks[torch.tensor(reached)], reference[torch.tensor(reached)])
        compared.append(sum(reached))
        return masks

    monkeypatch.setattr(GrammarState, "tree_masks", both)
    ids = llm.encode([PROMPT])[0]
    out = llm.generate([ids], SamplingParams(max_tokens=40, structured=output))[0]
    assert out.token_ids == reference_greedy(llm, ids, output, 40)
    assert out.finish_reason == "stop"  # the grammar completed and let only eos through
    text = out.text
    if kind == "json_schema":
        value = json.loads(text)
        assert set(value) == {"n", "name"} and isinstance(value["n"], int)
    elif kind == "regex":
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,6};", text)
    else:
        assert text in ("yes", "no", "maybe not")
    if policy == "eagle3" and kind != "choice":  # (joint decodes plainly on this CPU; a choice is two tokens)
        assert max(compared) > 1  # trees with nodes the grammar allows were masked


def test_drafting_proposes_only_what_the_grammar_allows_and_is_accepted_more(tiny, monkeypatch):
    """Under a JSON schema every drafted node whose path has nonzero draft probability is a token the
    grammar allows after its path, and the drafter's constrained trees are accepted more than unconstrained ones
    (same output either way: drafting never changes it)."""
    import trtllm_moespec.engine.engine as engine_module
    from trtllm_moespec.models.eagle3 import drafting as eagle3_draft

    llm, output = tiny["eagle3"], CONSTRAINTS["json_schema"]
    ids = llm.encode([PROMPT])[0]
    params = SamplingParams(max_tokens=40, structured=output)
    checked = []
    draft = eagle3_draft.draft_eagle3_trees

    def checking(*args, **kwargs):
        outs = draft(*args, **kwargs)
        constraint = (kwargs.get("constraints") or args[7])[0]
        if constraint is None:  # the unconstrained run below
            return outs
        tree = outs[0].tree
        tokens, parents = tree.token_ids[0].tolist(), tree.parents[0].tolist()
        scores = tree.log_scores[0].exp().tolist()  # the path's draft probability
        paths = eagle3_draft._paths_of(tokens, parents, list(range(len(tokens))))
        vocab = llm.engine.draft_source.drafter.draft_vocab_target_ids()
        column = {t: j for j, t in enumerate(vocab.tolist())}
        # the constraint on zero logits: 0 where the grammar allows a token after the path, -1e30 where not
        allowed = constraint([p[:-1] for p in paths], torch.zeros(len(paths), len(vocab)), vocab) > -1e29
        for v, (path, score) in enumerate(zip(paths, scores)):  # (fillers past a banned token score ~0)
            assert score < 1e-12 or allowed[v, column[path[-1]]], (path, score)
        checked.append(len(tokens))
        return outs

    monkeypatch.setattr(eagle3_draft, "draft_eagle3_trees", checking)
    guided = llm.generate([ids], params)[0]
    assert checked
    monkeypatch.setattr(engine_module, "draft_constraint", lambda request: None)
    free = llm.generate([ids], params)[0]
    assert guided.token_ids == free.token_ids
    assert guided.stats.mean_accepted_tokens > 1.5 * free.stats.mean_accepted_tokens


@pytest.mark.parametrize("policy, batch_policy", [("eagle3", None), ("joint", "joint-batch")])
def test_structured_requests_in_a_batch_equal_alone(tiny, policy, batch_policy):
    """eagle3's packed drafting, and joint-batch's selection over the batch (its guard off, so it speculates)."""
    llm = tiny[policy]
    prompts = llm.encode([PROMPT, "import os\n", "class Stack:\n"])
    params = [SamplingParams(max_tokens=32, structured=CONSTRAINTS["json_schema"]),
              SamplingParams(max_tokens=32),  # free text beside them
              SamplingParams(max_tokens=32, structured=CONSTRAINTS["regex"])]
    alone = [llm.generate([p], s)[0].token_ids for p, s in zip(prompts, params)]
    requests = [llm.make_request(p, s) for p, s in zip(prompts, params)]
    BatchedEngine(llm.engine, max_batch_size=3, batch_policy=batch_policy, goodput_guard=False).run_all(requests)
    assert [r.output_ids for r in requests] == alone
    assert max(s.verified_tokens for r in requests for s in r.steps) > 0  # the batch speculated


def test_sampled_tokens_follow_the_masked_distribution():
    """The first three sampled tokens under a regex, through a speculating engine that accepts drafts
    (its tree masked by the grammar), against the exact masked top-k law (seeded chi-square,
    deterministic; batches of 16 requests)."""
    llm, top_k, length = LLM("moespec-tiny", policy="eagle3", tree=TreeConfig(steps=3, topk=2, max_draft_tokens=6)), 6, 3
    output = StructuredOutput.of(regex=r"(def|class|import) [a-z_]+")
    prompt = llm.encode([PROMPT])[0]
    compiled = llm._grammars().compile(output)
    V = llm.target.vocab_size

    def mask(logits, out):
        matcher = xgr.GrammarMatcher(compiled)
        for t in out:
            assert matcher.accept_token(t)
        bitmask = xgr.allocate_token_bitmask(1, V)
        matcher.fill_next_token_bitmask(bitmask)
        return logits.masked_fill(~unpack_bitmask(bitmask, V)[0], -1e30)

    exact = exact_first_tokens(TINY_TARGET, prompt, length, top_k=top_k, adjust=mask,
                               stop=tuple(llm.target.eos_token_ids))
    draws = draw(llm, prompt, lambda seed: SamplingParams(max_tokens=length, temperature=1.0, top_k=top_k, seed=seed,
                                                          structured=output), 400, batch_size=16)
    assert draws.accepted >= 150, draws.accepted  # measured: 304 of 400
    assert_follows(draws, exact)


@pytest.mark.parametrize("make, message", [
    (lambda: SamplingParams(structured=StructuredOutput.of(json_object=True), ignore_eos=True), "ignore_eos"),
    (lambda: SamplingParams(structured=StructuredOutput.of(json_object=True), min_tokens=5), "min_tokens"),
    (lambda: StructuredOutput.of(regex="a", choice=["b"]), "one structured output constraint"),
    (lambda: StructuredOutput.of(json_schema="{not json"), "not valid JSON"),
    (lambda: StructuredOutput.of(choice=[]), "non-empty list"),
    (lambda: StructuredOutput("xml", "x"), "kind must be one of"),
    (lambda: SamplingParams(structured={"type": "json_object"}), "must be a StructuredOutput"),
])
def test_bad_structured_output_is_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_grammar_that_does_not_compile_is_refused_before_generating(tiny):
    with pytest.raises(ValueError, match="cannot compile the grammar constraint"):
        tiny["ar"].generate([PROMPT], SamplingParams(structured=StructuredOutput.of(grammar="root ::= (")))
