"""Function calling for chat completions: OpenAI's `tools` and `tool_choice`.

The tools go to the chat template (which tells the model about them). What comes back depends on
`tool_choice`:
- a named function: the output is constrained to that function's parameters schema (structured
  output), and is returned as its call's arguments;
- "required": the output is constrained to `{"name": one of the tools, "arguments": its schema}`;
- "auto": the model's text is parsed for calls by the server's `--tool-call-parser` (`hermes`:
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks, the format of Qwen's templates;
  `harmony`: GPT-OSS's channels, see `harmony_reply`); the text around them stays the message's content;
- "none": plain text.
The constrained kinds need no parser and work with any model; both are lossless like every
structured output (engine/structured.py).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..detokenize import IncrementalText, cut_text
from ..engine.structured import StructuredOutput

PARSERS = ("hermes", "harmony")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# one harmony message of an assistant's output: a header up to <|message|>, then its text up to the
# token that ends it (or the end of the output, when max_tokens cut it)
_HARMONY = re.compile(r"(?:<\|start\|>assistant)?(?P<header>(?:(?!<\|message\|>).)*)<\|message\|>"
                      r"(?P<body>.*?)(?:<\|end\|>|<\|return\|>|<\|call\|>|$)", re.DOTALL)
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


class ToolError(ValueError):
    """A bad `tools` / `tool_choice` (HTTP 400); `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it

    def to_openai(self) -> dict:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Tools:
    """A chat request's checked tools and tool choice ("none", "auto", "required" or a function name)."""

    functions: tuple[dict, ...]  # OpenAI's {"type": "function", "function": {...}} entries, as given
    choice: str
    named: bool = False  # `choice` is a function's name
    parallel: bool = True  # parallel_tool_calls: false returns only the first call an answer makes

    @property
    def names(self) -> list[str]:
        return [f["function"]["name"] for f in self.functions]

    def schema(self, name: str) -> dict:
        return self.functions[self.names.index(name)]["function"].get("parameters") or {"type": "object"}

    def constraint(self) -> StructuredOutput | None:
        """The structured output that makes the model call a tool (None: the text is free)."""
        if self.named:
            return StructuredOutput.of(json_schema=self.schema(self.choice))
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": self.schema(n)},
                      "required": ["name", "arguments"]} for n in self.names]
            return StructuredOutput.of(json_schema={"anyOf": calls})
        return None

    def calls(self, text: str, parser: str | None) -> tuple[list[ToolCall], str | None]:
        """(the calls in a finished output, the content left beside them). An output that does not
        parse (cut by max_tokens) is returned as content, with no calls."""
        if self.named:
            return ([ToolCall(self.choice, text)], None) if _is_json(text) else ([], text)
        if self.choice == "required":
            value = _json(text)
            if isinstance(value, dict) and value.get("name") in self.names:
                return [ToolCall(value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False))], None
            return [], text
        if self.choice == "auto" and parser == "hermes":
            calls, content = hermes_calls(text, self.names)
            return self.allowed(calls), content
        return [], text

    def allowed(self, calls: list[ToolCall]) -> list[ToolCall]:
        """The calls an answer returns: with parallel_tool_calls false, only its first."""
        return calls if self.parallel else calls[:1]


@dataclass(frozen=True)
class HarmonyReply:
    """A GPT-OSS output read by its channels: `final` is the answer, `analysis` the reasoning,
    `commentary` to a function a call (without a recipient, user-visible text like `final`)."""

    content: str | None
    reasoning: str | None
    calls: list[ToolCall]


def harmony_reply(raw: str, names: list[str], partial: bool = False) -> HarmonyReply:
    """An assistant output in OpenAI's harmony format, decoded with its special tokens, after the
    template's `<|start|>assistant`: `<|channel|>analysis<|message|>...<|end|><|start|>assistant
    <|channel|>final<|message|>...<|return|>`, or a call, `<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>{...}<|call|>` (the recipient may also precede the channel). Text
    with no harmony message is the content as it is (`partial`, an output still growing: unless it
    holds a harmony marker, the start of a message header); a call to an unknown function is dropped."""
    content, reasoning, calls, found = [], [], [], False
    for match in _HARMONY.finditer(raw):
        found = True
        header, body = match.group("header"), match.group("body")
        channel = re.search(r"<\|channel\|>(\w+)", header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            if recipient.group(1) in names:
                calls.append(ToolCall(recipient.group(1), body.strip()))
        elif channel is not None and channel.group(1) == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
    if not found:
        return HarmonyReply(None if partial and "<|" in raw else raw or None, None, [])
    return HarmonyReply("".join(content) or None, "".join(reasoning) or None, calls)


class HarmonyStream:
    """A harmony output's answer and reasoning as deltas while it grows (its calls wait for the end,
    when the whole text is read): `push` after each step, `finish` with the final message. Each push
    decodes the whole output (with its special tokens): exact, at ~0.15 ms per 1000 tokens on this CPU.
    The last `hold` characters of each channel wait (they may begin a stop string); `trim` is what a
    stop string cut off the end of the final tokens' text."""

    def __init__(self, decode_raw: Callable[[Sequence[int]], str], hold: int = 0):
        self.decode_raw, self.hold = decode_raw, hold
        self.sent = {"content": "", "reasoning_content": ""}

    def push(self, output_ids: Sequence[int], trim: int = 0) -> dict:
        reply = harmony_reply(cut_text(self.decode_raw(output_ids), trim), [], partial=True)
        return self._deltas(self._ready(reply.content), self._ready(reply.reasoning))

    def _ready(self, value: str | None) -> str:
        """A channel's text that may be sent: a trailing U+FFFD is a character whose bytes are still to
        come, and the held characters may begin a stop string."""
        value = (value or "").rstrip("\ufffd")
        return value[:max(len(value) - self.hold, 0)]

    def finish(self, message: dict) -> dict:
        return self._deltas(message.get("content") or "", message.get("reasoning_content") or "")

    def _deltas(self, content: str, reasoning: str) -> dict:
        deltas = {}
        for key, value in (("content", content), ("reasoning_content", reasoning)):
            delta = _grown(self.sent[key], value)
            if delta:
                deltas[key], self.sent[key] = delta, value
        return deltas


class HermesStream:
    """A chat answer as deltas while it grows, under the hermes parser ("auto" tool choice): the content
    before its first `<tool_call>` block, as `hermes_calls` returns it at the end (stripped: white space
    at either end waits, and so does text that may begin a block or a stop string), and each call once
    its block has closed. Any text after the first block, and calls not yet sent, come with the final
    message (`finish`)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], tools: Tools, hold: int = 0):
        self.text, self.tools, self.hold = IncrementalText(decode), tools, hold
        self.sent, self.calls_sent = "", 0

    def push(self, output_ids: Sequence[int], trim: int = 0) -> tuple[str, list[ToolCall]]:
        """(new content, calls whose blocks closed since the last push)."""
        text = cut_text(self.text.text(output_ids), trim).lstrip()
        ready = text[:max(len(text) - self.hold, 0)]  # what a stop string can no longer cut
        calls = self.tools.allowed(hermes_calls(ready[:ready.rfind(_CLOSE) + len(_CLOSE)], self.tools.names)[0]
                                   if _CLOSE in ready else [])
        new_calls, self.calls_sent = calls[self.calls_sent:], max(self.calls_sent, len(calls))
        block = text.find(_OPEN)
        if block < 0:  # hold what may begin a block (or a stop string) once more text comes
            block = len(text) - max(self.hold, _partial_marker(text, _OPEN))
        return self._delta(text[:max(block, 0)].rstrip("\ufffd").rstrip()), new_calls

    def finish(self, content: str | None, calls: list[dict]) -> tuple[str, list[dict]]:
        """(the content not yet sent, the final message's calls not yet sent)."""
        return self._delta(content or ""), calls[self.calls_sent:]

    def _delta(self, value: str) -> str:
        delta = _grown(self.sent, value)
        if delta:
            self.sent = value
        return delta


def _grown(sent: str, value: str) -> str:
    """What `value` adds to the text already sent ("" when it adds nothing or does not extend it)."""
    return value[len(sent):] if len(value) > len(sent) and value.startswith(sent) else ""


def _partial_marker(text: str, marker: str) -> int:
    """Characters at the end of `text` that begin `marker` (but are not all of it)."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:n])), 0)


def hermes_calls(text: str, names: list[str]) -> tuple[list[ToolCall], str | None]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks naming one of `names` -> calls;
    the rest of the text (stripped; None when empty) is the content. A block that does not parse,
    or names an unknown function, stays in the content."""
    calls, kept, end = [], [], 0
    for match in _HERMES.finditer(text):
        value = _json(match.group(1))
        if not (isinstance(value, dict) and value.get("name") in names):
            continue
        kept.append(text[end:match.start()])
        end = match.end()
        calls.append(ToolCall(value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False)))
    content = ("".join(kept) + text[end:]).strip()
    return calls, content or None


def parse_tools(body: dict) -> Tools | None:
    """A chat body's `tools` and `tool_choice` (None: no tools and no choice)."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError(f"'parallel_tool_calls' must be true or false, got {parallel!r}", "parallel_tool_calls")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not all(_is_function(t) for t in tools):
        raise ToolError("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ..., "
                        "\"parameters\": {...}}}", "tools")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ToolError("'tools' names a function twice", "tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise ToolError(f"'tool_choice' must name one of the tools ({', '.join(names)})", "tool_choice")
        return Tools(tuple(tools), name, named=True, parallel=parallel)
    if choice not in ("none", "auto", "required"):
        raise ToolError("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}", "tool_choice")
    return Tools(tuple(tools), choice, parallel=parallel)


def _is_function(tool: Any) -> bool:
    fn = tool.get("function") if isinstance(tool, dict) else None
    return (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)
            and isinstance(fn.get("name"), str) and bool(fn["name"])
            and isinstance(fn.get("parameters", {}), dict))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
