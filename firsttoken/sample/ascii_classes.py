"""ASCII meanings of the regular-expression classes \\d and \\w, as users of OpenAI's and vLLM's
structured output expect: llguidance reads them as Unicode classes, so `\\d` would also match
'🯸' or '٣'. A pattern that wants Unicode says so with `\\p{Nd}` or `\\p{L}`, which are kept."""

from __future__ import annotations

from typing import Any

_OUTSIDE_A_CLASS = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]"}
# Inside [...] only the positive classes can be spelled as ranges; \D and \W stay as given.
_INSIDE_A_CLASS = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(pattern: str) -> str:
    """`pattern` with \\d, \\w (and \\D, \\W outside brackets) spelled as ASCII ranges; every
    other escape, an escaped backslash included, is left as it is."""
    pieces: list[str] = []
    in_brackets = False
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\" and index + 1 < len(pattern):
            escaped = pattern[index + 1]
            table = _INSIDE_A_CLASS if in_brackets else _OUTSIDE_A_CLASS
            pieces.append(table.get(escaped, char + escaped))
            index += 2
            continue
        if char == "[" and not in_brackets:
            in_brackets = True
            pieces.append(char)
            # A "]" right after "[" or "[^" is a literal, not the end of the class.
            for opener in ("^", "]"):
                if pattern.startswith(opener, index + 1):
                    pieces.append(opener)
                    index += 1
            index += 1
            continue
        if char == "]" and in_brackets:
            in_brackets = False
        pieces.append(char)
        index += 1
    return "".join(pieces)


def ascii_schema_patterns(schema: Any) -> Any:
    """A copy of a JSON schema whose `pattern` strings and `patternProperties` keys read \\d and
    \\w as ASCII; walked without recursion."""
    root: dict[str, Any] = {"value": schema}
    pending: list[tuple[Any, Any]] = [(root, "value")]
    while pending:
        parent, key = pending.pop()
        item = parent[key]
        if isinstance(item, dict):
            copied = {}
            for name, child in item.items():
                if name == "pattern" and isinstance(child, str):
                    copied[name] = ascii_classes(child)
                elif name == "patternProperties" and isinstance(child, dict):
                    copied[name] = {ascii_classes(regex): value for regex, value in child.items()}
                    pending.extend((copied[name], regex) for regex in copied[name])
                else:
                    copied[name] = child
                    pending.append((copied, name))
            parent[key] = copied
        elif isinstance(item, list):
            parent[key] = list(item)
            pending.extend((parent[key], position) for position in range(len(item)))
    return root["value"]
