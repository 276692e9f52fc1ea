"""Tool calls in text: how a family's models write them (its `models/` file names the format as
TOOL_CALLS), read back into OpenAI's `tool_calls`, and the grammar that forces them (tool_choice
"required" or a named function: `hebrus.text.grammar`).

Formats:
- "qwen3_xml" (Qwen3.5): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
  </function>\\n</tool_call>`; a value is read as JSON where its parameter's schema says it is
  not a string (and it parses), else as the text it is.
- "hermes" (Qwen3-Next): `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`.
- "kimi" (Kimi-Linear): `<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>
  functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>`, then
  `<|tool_calls_section_end|>`; the section is one block, read as one or more calls.
- "dsml" (DeepSeek-V4): `<｜DSML｜tool_calls>` then per call `<｜DSML｜invoke name="NAME">`, its
  parameters `<｜DSML｜parameter name="KEY" string="true">TEXT</｜DSML｜parameter>` (a string taken as
  it is) or `string="false">JSON<...>`, `</｜DSML｜invoke>`, then `</｜DSML｜tool_calls>`; the marks'
  bars are fullwidth (U+FF5C), and ASCII bars are read as them.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from hebrus.errors import InvalidInput
from hebrus.text.grammar import Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KIMI_OPEN, KIMI_CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGUMENTS, KIMI_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_KIMI = re.compile(r"\s*" + re.escape(KIMI_CALL) + r"\s*functions\.([^:<]+):\d+\s*" + re.escape(KIMI_ARGUMENTS)
                   + r"(.*?)" + re.escape(KIMI_END) + r"\s*", re.DOTALL)
DSML = "\uff5cDSML\uff5c"
DSML_OPEN, DSML_CLOSE = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
_INVOKE = re.compile(rf'\s*<{DSML}invoke name="([^"\n]+)">(.*?)</{DSML}invoke>\s*', re.DOTALL)
_DSML_PARAMETER = re.compile(rf'\s*<{DSML}parameter name="([^"\n]+)" string="(true|false)">(.*?)</{DSML}parameter>\s*',
                             re.DOTALL)
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
    read as calls of `tools` stays in the text as it was."""
    (open_, close), read = FORMATS[form]
    text = _normal(text, form)
    block = re.compile(re.escape(open_) + r"(.*?)" + re.escape(close), re.DOTALL)
    calls, kept, at = [], [], 0
    for match in block.finditer(text):
        found = read(match.group(1), {t["function"]["name"]: t["function"] for t in tools})
        if not found:
            continue
        kept.append(text[at:match.start()])
        at = match.end()
        calls += found
    kept.append(text[at:])
    content = "".join(kept)
    return (content.strip() if calls else content), calls


def _one(read):
    """A reader of one call a block as a reader of a block's calls (none if it cannot be read)."""
    def calls(body: str, functions: dict[str, dict]) -> list[Call]:
        call = read(body, functions)
        return [] if call is None else [call]
    return calls


def _read_kimi(body: str, functions: dict[str, dict]) -> list[Call]:
    """A section's calls, every one of them a call of `functions` with a JSON object for its
    arguments, nothing else between them; else none."""
    calls, at = [], 0
    for match in _KIMI.finditer(body):
        if match.start() != at:
            return []
        at = match.end()
        name = match.group(1).strip()
        try:
            arguments = json.loads(match.group(2))
        except ValueError:
            return []
        if name not in functions or not isinstance(arguments, dict):
            return []
        calls.append(Call(name, json.dumps(arguments, ensure_ascii=False)))
    return calls if at == len(body) else []


def _read_dsml(body: str, functions: dict[str, dict]) -> list[Call]:
    """A block's invocations, each of a function of `functions`, its parameters strings or JSON
    as each says, nothing else between them; else none."""
    calls, at = [], 0
    for match in _INVOKE.finditer(body):
        if match.start() != at or match.group(1) not in functions:
            return []
        at = match.end()
        arguments, inner, params = {}, 0, match.group(2)
        for p in _DSML_PARAMETER.finditer(params):
            if p.start() != inner:
                return []
            inner = p.end()
            key, raw, value = p.groups()
            if raw == "true":
                arguments[key] = value
                continue
            try:
                arguments[key] = json.loads(value)
            except ValueError:
                return []
        if params[inner:].strip():
            return []
        calls.append(Call(match.group(1), json.dumps(arguments, ensure_ascii=False)))
    return calls if at == len(body) else []


def _normal(text: str, form: str) -> str:
    """DSML's marks with ASCII bars as with fullwidth ones (one character for one: positions
    in the text stay where they were)."""
    if form != "dsml":
        return text
    return text.replace("<|DSML|", f"<{DSML}").replace("</|DSML|", f"</{DSML}")


def _read_hermes(body: str, functions: dict[str, dict]) -> Call | None:
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


def _read_xml(body: str, functions: dict[str, dict]) -> Call | None:
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
    calls as each block closes: text from a block's opening (`<tool_call>`) on is held until it
    closes (a tail that could still begin one is held too)."""

    def __init__(self, form: str, tools: list[dict]):
        self.form, self.tools = form, tools
        (self.open, self.close), _ = FORMATS[form]
        self.text, self.shown, self.calls = "", 0, 0

    def add(self, piece: str) -> tuple[str, list[Call]]:
        """(content that may be shown now, calls completed now)."""
        self.text = _normal(self.text + piece, self.form)
        out, calls = "", []
        while True:
            rest = self.text[self.shown:]
            start = rest.find(self.open)
            if start < 0:
                held = next((n for n in range(min(len(self.open) - 1, len(rest)), 0, -1)
                             if rest.endswith(self.open[:n])), 0)
                out += rest[:len(rest) - held]
                self.shown += len(rest) - held
                return out, calls
            out += rest[:start]
            self.shown += start
            end = rest.find(self.close, start)
            if end < 0:
                return out, calls
            block = rest[start:end + len(self.close)]
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
    body = "(" + calls + ")" + many
    if form == "kimi":                      # the calls inside one section (its marks are special tokens, named bare)
        body = f"{KIMI_OPEN} {body} {KIMI_CLOSE}"
    elif form == "dsml":                    # the calls inside one block (its marks are text)
        body = f"{_quoted(DSML_OPEN + chr(10))} {body} {_quoted(DSML_CLOSE)}"
    return Grammar.lark("start: " + body + "\n" + "\n".join(rules) + '\nVALUE: /[^<]*/\n')


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
    if form == "kimi":
        return (f'{KIMI_CALL} {json.dumps("functions." + function["name"] + ":0")} {KIMI_ARGUMENTS} '
                f"%json {json.dumps(parameters)} {KIMI_END}")
    if form == "dsml":
        properties = parameters.get("properties") or {}
        each = " | ".join(_dsml_parameter(k, v) for k, v in properties.items())
        return (_quoted(f'<{DSML}invoke name="{function["name"]}">\n') + (f" ({each})*" if each else "")
                + " " + _quoted(f"</{DSML}invoke>\n"))
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


def _dsml_parameter(key: str, schema) -> str:
    """One parameter of a DSML invocation: text for a string (no '<' in it), else JSON of its schema."""
    schema = schema if isinstance(schema, dict) else {}
    kind = schema.get("type")
    raw = kind in (None, "string") or (isinstance(kind, list) and "string" in kind)
    head = _quoted(f'<{DSML}parameter name="{key}" string="{"true" if raw else "false"}">')
    value = "VALUE" if raw else f"%json {json.dumps(schema)}"
    return f"({head} {value} " + _quoted(f"</{DSML}parameter>\n") + ")"


def _quoted(text: str) -> str:
    """A grammar's string literal of `text`, its fullwidth bars as they are (not escaped)."""
    return json.dumps(text, ensure_ascii=False)


# each format: (the text that opens a block, the text that closes it), and the reader of a
# block's body into its calls (none: the block is text)
FORMATS = {"qwen3_xml": ((OPEN, CLOSE), _one(_read_xml)), "hermes": ((OPEN, CLOSE), _one(_read_hermes)),
           "kimi": ((KIMI_OPEN, KIMI_CLOSE), _read_kimi), "dsml": ((DSML_OPEN, DSML_CLOSE), _read_dsml)}
