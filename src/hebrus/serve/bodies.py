"""What the completion routes take: pydantic models with strict types. A field this server does
not implement is refused by name (a 400), never silently ignored: OpenAI's that it does not
implement (NOT_IMPLEMENTED) and any it does not know."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_CHOICES = 16                # n at most
MAX_PROMPTS = 64                # prompts in one /v1/completions body at most
MAX_TOP_LOGPROBS = 20

# OpenAI's fields this server knows and refuses (with what it takes instead, where there is something)
NOT_IMPLEMENTED = {
    "logit_bias": "", "echo": "", "suffix": "", "best_of": "", "functions": " (use tools)",
    "function_call": " (use tool_choice)", "audio": "", "modalities": "", "prediction": "", "web_search_options": "",
    "reasoning_effort": "", "service_tier": "", "store": "", "metadata": "",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchema(_Strict):
    name: str = Field(default="output", max_length=64)
    description: str | None = None
    schema_: dict | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's "text", "json_object" and "json_schema"; and this server's "regex" and "grammar"
    (a Lark grammar, llguidance's dialect)."""
    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: JsonSchema | None = None
    regex: str | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _complete(self):
        needs = {"json_schema": self.json_schema, "regex": self.regex, "grammar": self.grammar}
        if self.type in needs and needs[self.type] is None:
            raise ValueError(f"a response_format of type {self.type!r} needs its {self.type!r} field")
        return self


class _Common(_Strict):
    """The fields both completion routes take."""
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)     # None: the text-level default
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, max_length=256)
    response_format: ResponseFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data):
        if isinstance(data, dict):
            for name, instead in NOT_IMPLEMENTED.items():
                if name in data and data[name] is not None and not (name == "best_of" and data[name] == 1) \
                        and not (name == "echo" and data[name] is False):
                    raise ValueError(f"{name} is not supported by this server{instead}")
        return data

    @field_validator("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                     mode="before")
    @classmethod
    def _number(cls, value):
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("must be a number")
        return float(value)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty strings")
        return stops


class CompletionBody(_Common):
    """A prompt: text, token ids, or a list of either (each its own choices, `n` each)."""
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value):
        if isinstance(value, list) and value and not isinstance(value[0], int) and len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts")
        if isinstance(value, list) and not value:
            raise ValueError("an empty list holds no prompt")
        return value

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the body: one, or each of a list."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class TextPart(_Strict):
    type: str = Field(pattern="^text$")
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: str = Field(default="function", pattern="^function$")
    function: FunctionCall


class Message(_Strict):
    role: str = Field(pattern="^(system|user|assistant|developer|tool)$")
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _said(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is needed (only an assistant's message with tool_calls may leave it out)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant's message has tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class Function(_Strict):
    name: str = Field(pattern="^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value):
        if value is not None and not isinstance(value.get("properties", {}), dict):
            raise ValueError("parameters.properties must be an object")
        return value


class Tool(_Strict):
    type: str = Field(pattern="^function$")
    function: Function


class Named(_Strict):
    name: str


class ToolChoice(_Strict):
    type: str = Field(pattern="^function$")
    function: Named


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("each tool's function needs a name of its own")
        if isinstance(self.tool_choice, ToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        if self.tool_choice in ("required",) and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return self
