"""Tool calls in text: how a family's models write them (its `models/` file names the format as
TOOL_CALLS), read back into OpenAI's `tool_calls`, and the grammar that forces them (tool_choice
"required" or a named function: `hebrus.text.grammar`).

Formats:
- "qwen3_xml" (Qwen3.5): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
  </function>\\n</tool_call>`; a value is read as JSON where its parameter's schema says it is
  not a string (and it parses), else as the text it is.
- "hermes" (Qwen3-Next): `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from hebrus.errors import InvalidInput
from hebrus.text.grammar import Grammar

FORMATS = ("qwen3_xml", "hermes")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str              # a JSON object's text

    def openai(self, index: int | None = None) -> dict:
        out = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def split(text: str, form: str, tools: list[dict]) -> tuple[str, list[Call]]:
    """(the text outside the tool calls, the calls) of a model's output; a block that cannot be
    read as a call of one of `tools` stays in the text as it was."""
    calls, kept, at = [], [], 0
    for match in _BLOCK.finditer(text):
        call = _read(match.group(1), form, {t["function"]["name"]: t["function"] for t in tools})
        if call is None:
            continue
        kept.append(text[at:match.start()])
        at = match.end()
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept)
    return (content.strip() if calls else content), calls


def _read(body: str, form: str, functions: dict[str, dict]) -> Call | None:
    if form == "hermes":
        try:
            data = json.loads(body)
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or data["name"] not in functions:
            return None
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        return Call(data["name"], json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None
    match = _FUNCTION.match(body)
    if match is None or match.group(1).strip() not in functions:
        return None
    name = match.group(1).strip()
    properties = ((functions[name].get("parameters") or {}).get("properties") or {})
    arguments = {}
    for key, value in _PARAMETER.findall(match.group(2)):
        key, value = key.strip(), value.removeprefix("\n").removesuffix("\n")
        arguments[key] = _typed(value, properties.get(key))
    return Call(name, json.dumps(arguments, ensure_ascii=False))


def _typed(value: str, schema) -> object:
    """A parameter's text as its schema's type: JSON where the schema says it is not a string
    and the text parses, else the text."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


class Streamer:
    """A reply's text as it grows, split into what may be shown as content now and the tool
    calls as each one closes: text from a `<tool_call>` on is held until its block closes (a
    tail that could still begin one is held too)."""

    def __init__(self, form: str, tools: list[dict]):
        self.form, self.tools = form, tools
        self.text, self.shown, self.calls = "", 0, 0

    def add(self, piece: str) -> tuple[str, list[Call]]:
        """(content that may be shown now, calls completed now)."""
        self.text += piece
        out, calls = "", []
        while True:
            rest = self.text[self.shown:]
            start = rest.find(OPEN)
            if start < 0:
                held = next((n for n in range(min(len(OPEN) - 1, len(rest)), 0, -1) if rest.endswith(OPEN[:n])), 0)
                out += rest[:len(rest) - held]
                self.shown += len(rest) - held
                return out, calls
            out += rest[:start]
            self.shown += start
            end = rest.find(CLOSE, start)
            if end < 0:
                return out, calls
            block = rest[start:end + len(CLOSE)]
            _, found = split(block, self.form, self.tools)
            if found:
                calls += found
            else:
                out += block                    # not a call of these tools: it is content
            self.shown += len(block)

    def finish(self) -> str:
        """The rest of the text (an unclosed block included) once no more comes."""
        rest, self.shown = self.text[self.shown:], len(self.text)
        return rest


def forced(form: str, tools: list[dict], name: str | None, parallel: bool) -> Grammar:
    """The grammar of text that is only tool calls: of the function `name` (one call), or of any
    of `tools` (one, or with `parallel` one or more)."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise InvalidInput(f"no tool is named {name!r}")
    rules = [f"call_{i}: {_call_rule(form, f)}" for i, f in enumerate(chosen)]
    calls = " | ".join(f"call_{i}" for i in range(len(chosen)))
    many = "+" if parallel and name is None else ""
    return Grammar.lark("start: (" + calls + ")" + many + "\n" + "\n".join(rules) +
                        '\nVALUE: /[^<]*/\n')


def _value(schema) -> str:
    """A parameter's value in the qwen3_xml format as its schema allows: one of its enum, a
    boolean, an integer or a number, a string of at most its maxLength; else any text without
    a '<'."""
    schema = schema if isinstance(schema, dict) else {}
    kind = schema.get("type")
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return "(" + " | ".join(json.dumps(v if isinstance(v, str) else json.dumps(v)) for v in schema["enum"]) + ")"
    if kind == "boolean":
        return '("true" | "false")'
    if kind == "integer":
        return "/-?(0|[1-9][0-9]{0,17})/"
    if kind == "number":
        return "/-?(0|[1-9][0-9]{0,17})(\\.[0-9]{1,17})?/"
    if kind == "string" and isinstance(schema.get("maxLength"), int) and schema["maxLength"] >= 0:
        return f"/[^<]{{0,{schema['maxLength']}}}/"
    return "VALUE"


def _call_rule(form: str, function: dict) -> str:
    name = json.dumps(function["name"])[1:-1]
    parameters = function.get("parameters") or {"type": "object"}
    if form == "hermes":
        head = json.dumps(f'{OPEN}\n{{"name": "{name}", "arguments": ')
        return f"{head} %json {json.dumps(parameters)} " + json.dumps("}\n" + CLOSE + "\n")
    properties = parameters.get("properties") or {}
    if properties:
        each = " | ".join("(" + json.dumps(f"<parameter={k}>\n") + f" {_value(v)} " + json.dumps("\n</parameter>\n") + ")"
                          for k, v in properties.items())
        params = f"({each})*"
    else:
        params = ""
    return (json.dumps(f"{OPEN}\n<function={name}>\n") + f" {params} " + json.dumps(f"</function>\n{CLOSE}\n"))
