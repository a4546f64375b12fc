"""The bad inputs the tests cover, one row each: the source of `docs/bad_inputs.md`.

Every id here is exercised by a test in `tests/test_cli.py` (the real `moespec` command in a
subprocess), `tests/engine/test_bad_input.py` or `tests/bench/test_bench.py`; `tests/test_cli.py`
checks that each id appears in a test and that the docs table is this list, rendered. After adding
a case: `python -m tests.bad_input_cases > docs/bad_inputs.md`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    id: str  # referenced by the test that covers it
    surface: str  # "CLI" (subprocess), "API", "bench"
    bad_input: str
    result: str  # what the user gets now (errors: one line, exit code 2 on the CLI)


CASES: tuple[Case, ...] = (
    # --- data loss and silent wrong output
    Case("missing-tensor", "CLI", "a checkpoint missing one tensor (`...layers.0.self_attn.q_proj.weight`)",
         "error naming the missing tensor (was: rc 0, a randomly initialised layer)"),
    Case("bench-ctrl-c-keeps-report", "bench", "Ctrl-C (twice) while models load, `--json` naming a finished report",
         "the finished report is kept, the partial one goes to `NAME.partial.json`, exit 130, no traceback"),
    Case("bench-abort-keeps-report", "bench", "a T=0 mismatch abort with `--json`/`--markdown` naming existing files",
         "existing files kept, the aborted report goes to `NAME.partial.EXT`"),
    Case("stop-inside-token", "API", "a stop string that begins inside a token (`stop=[\":\"]`, the model emits the token `\"):\"`)",
         "the text ends where the stop string begins, `)` kept; the token stays in the output (was: the whole "
         "token and its `)` dropped)"),
    Case("target-model-mismatch", "API", "`LLM(target_model=other.target)` loaded with another dtype, device or model_impl",
         "error naming what differs (sharing it would run this LLM on weights it did not ask for)"),
    Case("stream-utf8", "API", "streaming text whose multi-byte characters span tokens",
         "incomplete characters are held back: no U+FFFD the final text lacks; joined chunks == final text"),
    # --- crashes and tracebacks
    Case("tree-over-nodes", "CLI", "`--tree 4,8,100000` (more verified nodes than the tree drafts)",
         "error: max_draft_tokens <= topk + (steps-1)*topk^2 (was: OOM)"),
    Case("tree-too-big", "CLI", "`--tree 4,10000,32`", "error: the tree drafts 300010000 nodes, the limit is 4096 (was: OOM)"),
    Case("tree-topk-over-vocab", "CLI", "`--tree 1,200,8` with a 128-token drafter vocabulary",
         "error: topk exceeds the drafter's vocabulary"),
    Case("hidden-size-mismatch", "CLI", "config.json `hidden_size` that does not match the weights",
         "error naming a tensor and both shapes (was: transformers RuntimeError)"),
    Case("foreign-drafter-joint", "API", "a drafter of another width (128) with the default `joint` policy",
         "the shipped draft-head predictor is not paired with it: the standalone predictor is used"),
    Case("head-predictor-foreign-drafter", "API", "`predictor=<draft-head dir>` with a drafter of another width",
         "error before any generation (was: mid-generation, after text was printed)"),
    Case("head-predictor-ngram", "API", "`predictor=<draft-head dir>` with `drafter='ngram'`",
         "error before any generation (was: mid-generation)"),
    Case("profile-expert-model-field", "CLI", "cost profile with `\"expert_model\": {\"c0\": \"x\"}`",
         "error naming the file and `expert_model.c0` (was: TypeError traceback)"),
    Case("profile-costs-field", "CLI", "cost profile with `\"costs\": \"abc\"`",
         "error naming the file and `costs` (was: could not convert string to float)"),
    Case("policy-defaults-unknown-option", "CLI", "a model's `policy_defaults.json` tuning an option the policy "
         "does not take (`{\"gamma\": 5}`)", "error naming the file, the policy and the option, before any weights load"),
    Case("prompt-file-directory", "CLI", "`--prompt-file` naming a directory", "error naming the path (was: traceback)"),
    Case("device-tpu", "CLI", "`--device tpu`", "error: unknown device (was: traceback)"),
    Case("seed-huge", "CLI", "`--seed 99999999999999999999999`",
         "error: seed in [0, 2**64), before anything loads (was: overflow after loading)"),
    Case("prompt-too-long", "CLI", "a prompt longer than the context", "error, the prompt is not echoed first"),
    Case("max-tokens-huge", "CLI", "`--max-tokens 1000000000`", "error, the prompt is not echoed first"),
    Case("prompt-file-not-utf8", "CLI", "a prompt file that is not UTF-8", "error naming the file and the byte"),
    # --- friction
    Case("api-threads", "API", "`LLM(...)` on a CPU with torch's default thread count",
         "the API sets 1 intra-op thread as the CLI does (`threads=None` leaves torch alone)"),
    Case("model-before-profile", "CLI", "an empty model directory with the default `joint` policy",
         "reported as a model problem (no config.json), not as a missing cost profile"),
    Case("pickle-before-profile", "CLI", "a pickle-only model directory with the default `joint` policy",
         "reported as pickle weights (safetensors only), not as a missing cost profile"),
    Case("dtype-int8", "CLI", "`--dtype int8`", "error: invalid choice (float32, bfloat16, float16)"),
    Case("chat-tiny", "API", "`llm.chat(messages)` on moespec-tiny",
         "error: no chat template (the model is not chat-tuned; pass `chat_template=`) (was: advertised, untested)"),
    Case("prompt-and-prompt-file", "CLI", "`--prompt` with `--prompt-file`", "error: not allowed together"),
    Case("policy-choice", "CLI", "`--policy fastest`", "error: invalid choice, the policies listed"),
    Case("help-texts", "CLI", "`moespec generate --help`, `moespec bench --help`",
         "every generate option has help; bench shows its defaults"),
    # --- the server (issue 27): real servers over loopback, tests/serve/test_robustness.py, test_shutdown.py
    Case("serve-10mb-prompt", "serve", "a 10 MB prompt to `/v1/completions`",
         "413 under the default `--max-request-bytes` (8 MiB), on its Content-Length before the body is read "
         "(was: tokenized on the event loop: /health waited 21-23 s, a stream 43 s, RSS 0.6 -> 2.4 GB)"),
    Case("serve-health-during-tokenize", "serve", "a 1 MB prompt with `--max-request-bytes` raised",
         "tokenized in a worker thread: /health answers and other streams go on meanwhile; then 400 (too long)"),
    Case("serve-lone-surrogate", "serve", "a lone surrogate (`\"\\ud800\"`) in a prompt or a message",
         "400 naming the field (`prompt`, `messages[0].content`) (was: plain-text 500 and a traceback)"),
    Case("serve-nested-json", "serve", "100,000-level nested JSON (or 200 levels in any field)",
         "400: nested deeper than 128 levels (was: plain-text 500 and a RecursionError traceback)"),
    Case("serve-unknown-path", "serve", "an unknown path, a wrong method, a bug inside a handler",
         "OpenAI's JSON error: 404, 405, 500 with its message (one log line, no traceback)"),
    Case("serve-template-raises", "serve", "a chat template that raises on the conversation (`raise_exception`)",
         "400 carrying the template's message"),
    Case("serve-chat-template-error", "serve", "`--chat-template` with a Jinja syntax error, or one that cannot "
         "render one user message", "exit 2, one line naming the file and the line (a syntax error: before the "
         "model loads) (was: the server started, then every chat failed)"),
    Case("serve-queue-by-default", "serve", "more than 72 requests waiting or running, with the defaults",
         "they wait their turn (was: 503)"),
    Case("serve-never-fits", "serve", "one request of more sequences (prompts x n) than batch + `--max-queue`",
         "400 (`param` `n`), nothing queued or cancelled; beyond a full bounded queue, 503 with `Retry-After` "
         "(was: 503 on an idle server, counted as 72 cancellations)"),
    Case("serve-failure-counters", "serve", "requests answered 400 or 500",
         "counted in `moespec_request_errors_total{status_code}`, the 500s in `moespec_requests_failed_total` "
         "(was: 0 through the 500s)"),
    Case("serve-load-100", "serve", "100 concurrent clients against the default settings",
         "every one answered, 0 errors"),
    Case("serve-sigterm-drain", "serve", "SIGTERM with streams in flight",
         "short ones finish; at `--shutdown-timeout` the rest end with an error event (code 503) and `[DONE]` "
         "(was: 5 s more decoding, then cut with no terminal event)"),
    Case("serve-sigterm-exit-0", "serve", "SIGTERM to `moespec serve`", "drains, exit 0 (was: exit 143)"),
    Case("serve-sigint-no-traceback", "serve", "Ctrl-C on `moespec serve`",
         "drains as SIGTERM does, exit 0, no traceback (was: two CancelledError tracebacks)"),
    # --- the next ten of the same kind
    Case("sampling-field-types", "API", "`SamplingParams(temperature='hot')`, `top_k=True`, `max_tokens=True`",
         "error naming the field (was: float() message, or True silently meaning 1)"),
    Case("stop-not-string", "API", "`SamplingParams(stop=[1])`", "error at construction (was: TypeError mid-generation)"),
    Case("prompt-float-ids", "API", "prompt token ids `[1.7, 2]`", "error (was: silently truncated to `[1, 2]`)"),
    Case("model-not-a-path", "API", "`LLM(model=123)`", "error (was: TypeError traceback)"),
    Case("argument-types", "API", "`LLM(draft_model=123)`, `cost_profile=1.5`, `predictor=['x']`, "
         "`ddd_threshold='x'`, `policy_options=[...]`", "error naming the argument (was: TypeError tracebacks)"),
    Case("threads-out-of-range", "CLI", "`--threads 0`, `threads=10**6` in the API", "error naming the range"),
    Case("config-not-object", "CLI", "a config.json holding a JSON list, or not UTF-8",
         "error naming config.json (was: AttributeError / UnicodeDecodeError)"),
    Case("chat-bad-messages", "API", "`llm.chat('hello')` or messages without role/content",
         "error describing the expected list of dicts (was: template traceback)"),
    Case("broken-pipe", "CLI", "`moespec generate ... | head -c 1`", "exits quietly (was: BrokenPipeError traceback)"),
    Case("bench-output-is-directory", "bench", "`--json` naming a directory (or `--plots` a file)",
         "error before the run (was: traceback after the whole run)"),
    Case("max-tokens-zero", "CLI", "`--max-tokens 0`", "error before torch loads"),
    Case("prompt-file-missing", "CLI", "`--prompt-file` that does not exist", "error naming the file"),
    # --- logit rules
    Case("penalty-out-of-range", "CLI", "`--presence-penalty 3`", "error naming the field and its range [-2, 2]"),
    Case("logit-rules-out-of-range", "API", "`SamplingParams(logit_bias={3: 101})`, `min_tokens=-1`, `min_p=1.5`, "
         "`stop_token_ids=[-2]`, `repetition_penalty=0`", "error naming the field at construction"),
    Case("structured-bad-regex", "CLI", "`--regex '('` (or a schema file that is not JSON, a grammar that does not "
         "parse)", "error naming the constraint and xgrammar's reason, before anything is generated"),
    Case("logit-bias-outside-vocab", "API", "`logit_bias={10**6: 1.0}` on a 4096-token model",
         "error naming the vocabulary size, before generating"),
    # --- issue 27: files, API shapes, the CLI's words
    Case("bench-output-unwritable", "CLI", "`moespec bench --json` (or `profile --out`, `replay record --out`) "
         "in a folder no file can be created in", "error naming the flag and the folder, before the run (was: the "
         "whole measurement, then the report lost)"),
    Case("profile-out-unwritable", "CLI", "`moespec profile --out /sys/moespec/p.json`",
         "error naming `--out`, before anything is measured"),
    Case("replay-out-unwritable", "CLI", "`moespec replay record --out` in a folder that cannot take files",
         "error naming `--out`, before anything is recorded"),
    Case("bench-final-write-fails", "bench", "the disk fills up (or turns read-only) during `bench --json/--markdown`",
         "the report goes to the temporary directory (else stdout), stderr names where, exit 1 (was: lost)"),
    Case("profile-final-write-fails", "bench", "the final write of `moespec profile` fails",
         "the profile goes to the temporary directory (else stdout), stderr names where, exit 1"),
    Case("bench-sigterm", "bench", "SIGTERM during `moespec bench` (what `timeout`, CI and `kill` send)",
         "handled as Ctrl-C: a partial report (`NAME.partial.json` beside a finished one), exit 143 (was: nothing kept)"),
    Case("report-umask", "bench", "reports, profiles and replay records written under umask 022",
         "mode 0644 (0o666 less the umask; an existing file keeps its mode) (was: 0600 from tempfile / safetensors)"),
    Case("generation-config-broken", "CLI", "a `generation_config.json` that is not valid JSON",
         "error naming the file and the position (was: silently ignored, and the eos ids come from it)"),
    Case("generation-config-eos", "CLI", "`generation_config.json` with `\"eos_token_id\": \"</s>\"`",
         "error naming the file and `eos_token_id`"),
    Case("tokenizer-json-broken", "CLI", "a `tokenizer.json` that is not valid JSON",
         "error naming the file and the position, before any weights load (was: JSONDecodeError traceback)"),
    Case("allowed-token-ids-empty", "API", "`SamplingParams(allowed_token_ids=[])` (server: `\"allowed_token_ids\": []`)",
         "error: no token could be drawn, as vLLM refuses it (was: no restriction)"),
    Case("cli-names-flags", "CLI", "`moespec generate --model DIR --policy eagle3` without a drafter (any API error)",
         "the message names `--draft-model DIR` and `--drafter ngram`, not `draft_model=` (was: Python arguments)"),
    Case("speculative-config-twice", "API", "`LLM(policy='ar', speculative_config=MoESpecConfig(...))`",
         "error naming the keywords given in both places (one would be silently ignored)"),
    Case("sampling-params-per-prompt", "API", "`generate(prompts, [sp])` with fewer SamplingParams than prompts, "
         "or a dict", "error: one SamplingParams for all, or one per prompt (was: AttributeError)"),
    Case("stream-n", "API", "`llm.stream(prompt, SamplingParams(n=2))`", "error: stream() decodes one completion"),
)


def markdown() -> str:
    """The docs table."""
    lines = ["# Bad inputs the tests cover", "",
             "Generated from `tests/bad_input_cases.py` (`python -m tests.bad_input_cases > docs/bad_inputs.md`);",
             "`tests/test_cli.py` checks that this file matches and that every row has a test. CLI rows run the",
             "real `moespec` command; errors are one line on stderr with exit code 2.", "",
             "| id | where | bad input | result |", "|---|---|---|---|"]
    lines += [f"| `{c.id}` | {c.surface} | {c.bad_input} | {c.result} |" for c in CASES]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
