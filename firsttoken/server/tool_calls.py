"""Tool calls in the Hermes format (the one SmolLM2, Qwen2.5 and Hermes models use): the tools
described to the model, the grammar that forces a call, and calls parsed back from the output.

The model writes a call as a JSON object between tags, after any text of its own:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Prompt. A chat template that renders `tools` itself (Qwen2.5's, Hermes') gets them, as
transformers passes them. A template without tool support (SmolLM2's embedded one) gets the
conversation rewritten the way Qwen2.5's template writes it: the tools and the call format
appended to the system message, an assistant's calls as <tool_call> blocks in its content, and
tool results as a user turn of <tool_response> blocks; so any model with a ChatML-like template
can take part in a tool round trip.

Forcing. tool_choice "required" (one call or more; one with parallel_tool_calls false) and a
named function (one call to it) are grammars: the tags around a JSON object whose name is one of
the allowed tools and whose arguments follow that tool's parameters schema. An object in that
schema that does not say whether it allows more properties allows none (as OpenAI's strict
function calling requires of every schema): otherwise the grammar could go on adding keys, and
a call that cannot end is cut by max_tokens.

Cut off. A call is never shown as text: one whose body is not a whole call is dropped, and one
still open when the output ends (max_tokens cut it, or the model stopped before the end tag)
counts only where its body is a whole call. An end tag inside a JSON
string is the argument's text, not the call's end (a forced call's strings may hold anything).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from firsttoken.sampling_params import StructuredOutput

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# JSON inside a forced call as json.dumps writes it (see sample/grammar.py's JSON_STYLE).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ParsedToolCall:
    """One call the model made: a generated id, the function's name, its arguments as JSON text."""

    id: str
    name: str
    arguments: str


def tools_system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The tools block Qwen2.5's template appends to the system message."""
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{signatures}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f"{TOOL_CALL_START}{TOOL_CALL_END} XML tags:\n{TOOL_CALL_START}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n' + TOOL_CALL_END
    )


def hermes_conversation(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation with tools, calls and results written as text, for a template that has
    no tool support of its own: only roles and string contents remain."""
    rewritten: list[dict[str, Any]] = []
    if tools:
        if messages and messages[0]["role"] == "system":
            system = {
                "role": "system",
                "content": messages[0]["content"] + "\n\n" + tools_system_prompt(tools),
            }
            messages = messages[1:]
        else:
            system = {"role": "system", "content": tools_system_prompt(tools)}
        rewritten.append(system)
    follows_a_tool = False  # consecutive tool results share one user turn
    for message in messages:
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if follows_a_tool:
                rewritten[-1]["content"] += "\n" + response
            else:
                rewritten.append({"role": "user", "content": response})
            follows_a_tool = True
            continue
        follows_a_tool = False
        if message["role"] == "assistant" and message.get("tool_calls"):
            blocks = [_call_block(call["function"]) for call in message["tool_calls"]]
            content = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
            rewritten.append({"role": "assistant", "content": content})
        else:
            rewritten.append({"role": message["role"], "content": message["content"]})
    return rewritten


def _call_block(function: dict[str, Any]) -> str:
    arguments = function["arguments"]
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    call = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{call}\n{TOOL_CALL_END}"


def forcing_constraint(
    tools: Sequence[dict[str, Any]], forced_name: str | None, parallel: bool = True
) -> StructuredOutput:
    """The grammar of tool_choice "required" (calls to any tool, one or more; exactly one unless
    `parallel`), or of a named function (exactly one call to it)."""
    functions = [
        tool["function"] for tool in tools if forced_name is None or tool["function"]["name"] == forced_name
    ]
    call_schema = {
        "anyOf": [_call_schema(function) for function in functions],
        "x-guidance": _JSON_STYLE,
    }
    call = f'"{TOOL_CALL_START}\\n" %json {json.dumps(call_schema)} "\\n{TOOL_CALL_END}"'
    start = 'call ("\\n" call)*' if forced_name is None and parallel else "call"
    return StructuredOutput(grammar=f"start: {start}\ncall: {call}\n", field="tool_choice")


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = closed_objects(function.get("parameters") or {"type": "object", "properties": {}})
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def closed_objects(schema: Any) -> Any:
    """A copy of a JSON schema where every object schema without `additionalProperties` gets
    `additionalProperties: false`; one that says what it allows keeps it."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    is_object = closed.get("type") == "object" or "properties" in closed
    if is_object and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    for key in _SUBSCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(item) for item in closed[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(item) for name, item in closed[key].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(closed.get(key), dict):
            closed[key] = closed_objects(closed[key])
    return closed


class ToolCallParser:
    """Splits a model's output, as it streams, into its own text and its tool calls. Text that
    may be the start of a <tool_call> tag is held back until it is known not to be. Without
    `parallel`, only the first call counts (OpenAI's parallel_tool_calls false); later ones are
    dropped."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.num_calls = 0
        self._buffer = ""
        self._in_call = False
        self._after_call = False
        self._call_end = _CallEndScanner()

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """(the text now known to be the model's own, the calls completed) after `text`."""
        self._buffer += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._call_end.find(self._buffer)
                if end < 0:
                    return content, calls
                body, self._buffer = self._buffer[:end], self._buffer[end + len(TOOL_CALL_END) :]
                self._in_call = False
                call = self._parse(body)  # None: not a call, dropped all the same
                if call is not None and (self.parallel or self.num_calls == 0):
                    self.num_calls += 1
                    calls.append(call)
                self._after_call = True
                continue
            if self._after_call:
                # The newlines between and after calls are the format's, not the model's text.
                self._buffer = self._buffer.lstrip()
                if not self._buffer:
                    return content, calls
                self._after_call = False
            start = self._buffer.find(TOOL_CALL_START)
            if start >= 0:
                content += self._buffer[:start]
                self._buffer = self._buffer[start + len(TOOL_CALL_START) :]
                self._in_call = True
                self._call_end = _CallEndScanner()
                continue
            held = _longest_tag_prefix_suffix(self._buffer)
            content += self._buffer[: len(self._buffer) - held]
            self._buffer = self._buffer[len(self._buffer) - held :]
            return content, calls

    def finish(self, cut_off: bool = False) -> tuple[str, list[ParsedToolCall]]:
        """(the text still held back, the call it completes) at the end of the output. A call the
        output ends inside counts where its body is a whole call (a model may stop before the end
        tag, as vLLM's Hermes parser allows), and is dropped otherwise; so is a held part of a
        start tag when max_tokens cut the output (`cut_off`): a call that never began. A model
        that ended on such a part wrote it as text."""
        calls = []
        if self._in_call:
            call = self._parse(self._buffer)
            if call is not None and (self.parallel or self.num_calls == 0):
                self.num_calls += 1
                calls.append(call)
        rest = "" if cut_off or self._in_call else self._buffer
        self._buffer, self._in_call = "", False
        return rest, calls

    @staticmethod
    def _parse(body: str) -> ParsedToolCall | None:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        return ParsedToolCall(
            id=f"call_{uuid.uuid4().hex[:24]}",
            name=call["name"],
            arguments=json.dumps(arguments, ensure_ascii=False),
        )


class _CallEndScanner:
    """Finds an open call's end tag outside the JSON strings of its body, scanning each character
    once however the output is split."""

    def __init__(self) -> None:
        self._scanned = 0
        self._in_string = False
        self._escaped = False

    def find(self, body: str) -> int:
        """Where the end tag starts in `body` (the call's text so far), or -1 not yet."""
        while self._scanned < len(body):
            position, char = self._scanned, body[self._scanned]
            if self._escaped:
                self._escaped = False
            elif self._in_string:
                self._escaped = char == "\\"
                self._in_string = char != '"'
            elif char == '"':
                self._in_string = True
            elif body.startswith(TOOL_CALL_END, position):
                return position
            elif TOOL_CALL_END.startswith(body[position:]):
                return -1  # perhaps the tag, not all of it here yet: look again with more
            self._scanned += 1
        return -1


def _longest_tag_prefix_suffix(text: str) -> int:
    """How many of text's last characters are a proper prefix of the start tag."""
    for length in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-length:]):
            return length
    return 0


def parse_tool_calls(
    text: str, parallel: bool = True, cut_off: bool = False
) -> tuple[str | None, list[ParsedToolCall]]:
    """A whole output's own text (None when only calls) and its calls (see ToolCallParser)."""
    parser = ToolCallParser(parallel)
    content, calls = parser.feed(text)
    rest, last_calls = parser.finish(cut_off)
    content = (content + rest).strip()
    return (content or None), calls + last_calls
