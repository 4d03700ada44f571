"""Tool calls as models write them, and what they mean.

Two formats, chosen per episode by the policy that samples it:

- `hermes`: `<tool_call>{"name": "sql", "arguments": {"query": "..."}}</tool_call>`, the format the chat
  templates of Qwen2.5, SmolLM2 and Hermes models are trained on;
- `plain`, for the built-in byte-level policy: a turn starting with `@` is a call, `@name argument`
  (the argument is the rest of the turn: the tool's only parameter) or `@name {json object}`.

A turn with no call is the episode's answer. A turn that tries to call and gets it wrong (broken
JSON, no name, an unknown tool, missing or extra arguments) is a call with an `error`: the
environment answers it with an observation saying what was wrong, and the episode goes on. A turn makes
one call: a Hermes turn that writes several reads the first, and its observation ends saying so (before,
the others were dropped without a word, and the model read the answer to one call as the answer to all).
"""
from __future__ import annotations

import json
import re

from crucible.ml.envs.base import MAX_ARGUMENTS_CHARS, Call, Tool
from crucible.ml.kinds.extract import after_thinking
from crucible.shared.text import is_unicode
from crucible.v1 import episode_pb2

FORMATS = ("hermes", "plain")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|$)", re.DOTALL)


def parse(text: str, call_format: str) -> episode_pb2.ToolCall | None:
    """The call a turn makes (with `error` set when malformed), or None when the turn is an answer."""
    if call_format not in FORMATS:
        raise ValueError(f"unknown call format {call_format!r}: {', '.join(FORMATS)}")
    # What follows the thinking, as an answer is read (extract.after_thinking): a call written while
    # thinking is thought about, not made.
    return _parse_plain(text) if call_format == "plain" else _parse_hermes(after_thinking(text))


_NOT_UNICODE = "the call holds text that is not valid Unicode (an escaped lone surrogate such as \\ud800)"


def _call(name: str, arguments: dict) -> episode_pb2.ToolCall:
    """The call of a name and arguments JSON made: what a model wrote is text, what JSON makes of it may
    not be (a lone surrogate, which no protobuf string takes; arguments nested so deep that reading them
    again overflows the stack). Arguments are flat: strings and numbers."""
    nested = [p for p, v in arguments.items() if isinstance(v, (dict, list))]
    if not is_unicode([name, list(arguments)]):
        return episode_pb2.ToolCall(error=_NOT_UNICODE)
    if nested:
        return episode_pb2.ToolCall(name=name[:100], error=f"arguments {', '.join(nested)[:200]} must be strings, "
                                                            "not objects or lists")
    if not is_unicode(arguments):
        return episode_pb2.ToolCall(name=name[:100], error=_NOT_UNICODE)
    return episode_pb2.ToolCall(name=name[:100], arguments_json=json.dumps(arguments))


def _parse_hermes(text: str) -> episode_pb2.ToolCall | None:
    match = _HERMES.search(text)
    if match is None:
        return None
    body, closed = match.group(1).strip(), bool(match.group(2))
    if not closed:
        return episode_pb2.ToolCall(error=f"the call is not closed with {CLOSE}")
    if len(body) > MAX_ARGUMENTS_CHARS:
        return episode_pb2.ToolCall(error=f"the call is {len(body)} characters long: at most {MAX_ARGUMENTS_CHARS}")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return episode_pb2.ToolCall(error=f"the call is not valid JSON ({str(exc)[:120]})")
    if not isinstance(data, dict):
        return episode_pb2.ToolCall(error='the call must be a JSON object {"name": ..., "arguments": {...}}')
    name, arguments = data.get("name"), data.get("arguments", {})
    if not isinstance(name, str) or not name:
        return episode_pb2.ToolCall(error='the call has no "name" (a string)')
    if not is_unicode(name):
        return episode_pb2.ToolCall(error=_NOT_UNICODE)
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return episode_pb2.ToolCall(name=name[:100], error='"arguments" must be a JSON object')
    return _call(name, arguments)  # one call a turn: the first


def calls_ignored(text: str, call_format: str) -> int:
    """How many calls a turn wrote after the one it makes (one call a turn: the first, made or refused),
    so that its observation can say so: each closed <tool_call> after the first (a tag named in prose
    is none); a plain turn is one call whatever it holds."""
    if call_format != "hermes":
        return 0
    return sum(1 for match in list(_HERMES.finditer(after_thinking(text)))[1:] if match.group(2))


def _parse_plain(text: str) -> episode_pb2.ToolCall | None:
    stripped = text.strip()
    if not stripped.startswith("@"):
        return None
    name, _, rest = stripped[1:].partition(" ")
    name, rest = name.strip(), rest.strip()
    if not name:
        return episode_pb2.ToolCall(error="a call is written @name argument")
    if len(rest) > MAX_ARGUMENTS_CHARS:
        return episode_pb2.ToolCall(name=name[:100], error=f"the argument is {len(rest)} characters long: "
                                    f"at most {MAX_ARGUMENTS_CHARS}")
    if rest.startswith("{"):
        try:
            arguments = json.loads(rest)
        except (ValueError, RecursionError) as exc:
            return episode_pb2.ToolCall(name=name[:100], error=f"the arguments are not valid JSON ({str(exc)[:120]})")
        if isinstance(arguments, dict):
            return _call(name, arguments)
    # the rest of the turn is the tool's only argument (checked against the tool by `resolve`)
    return episode_pb2.ToolCall(name=name[:100], arguments_json=json.dumps({"": rest}))


def resolve(call: episode_pb2.ToolCall, tools: tuple[Tool, ...]) -> Call | str:
    """The call checked against the environment's tools: a Call, or what is wrong with it (a sentence)."""
    if call.error:
        return f"malformed tool call: {call.error}"
    by_name = {t.name: t for t in tools}
    tool = by_name.get(call.name)
    if tool is None:
        return f"unknown tool {call.name!r}: the tools are {', '.join(sorted(by_name))}"
    arguments = json.loads(call.arguments_json or "{}")
    if "" in arguments:  # a plain call's single argument
        if len(tool.parameters) != 1:
            wanted = ", ".join(tool.parameters) or "none"
            if not tool.parameters and not arguments[""]:
                return Call(tool.name, {})
            return f"tool {tool.name!r} takes the arguments {wanted}: write @{tool.name} {{json object}}"
        arguments = {next(iter(tool.parameters)): arguments[""]}
    missing = [p for p in tool.parameters if p not in arguments]
    extra = [p for p in arguments if p not in tool.parameters]
    if missing or extra:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(extra)}"] if extra else [])
        return (f"tool {tool.name!r} takes the arguments {', '.join(tool.parameters) or 'none'} "
                f"({'; '.join(parts)})")
    bad = [p for p, v in arguments.items() if not isinstance(v, (str, int, float)) or isinstance(v, bool)]
    if bad:
        return f"tool {tool.name!r}: arguments {', '.join(bad)} must be strings"
    return Call(tool.name, {p: str(v) for p, v in arguments.items()})


def describe_plain(tools: tuple[Tool, ...]) -> str:
    return "\n".join(f"@{t.name} {' '.join(f'<{p}>' for p in t.parameters)}: {t.description}" for t in tools)


def describe_hermes(tools: tuple[Tool, ...]) -> str:
    """The tools as a system prompt says them where the chat template has no tools section."""
    schemas = "\n".join(json.dumps(t.schema()) for t in tools)
    return ("You may call tools. The tools are, as JSON schemas:\n<tools>\n" + schemas + "\n</tools>\n"
            'To call one, reply with <tool_call>{"name": <tool name>, "arguments": <an object>}</tool_call>.')
