"""What the completion routes take: pydantic models with strict types for the known fields,
unknown fields ignored, the fields this server does not support refused by name."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    """The fields both completion routes take; unknown fields are ignored, known ones checked."""
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)     # None: the text-level default
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, max_length=256)

    @field_validator("temperature", "top_p", "min_p", mode="before")
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
    prompt: str | list[int]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None

    @field_validator("echo", "best_of", "suffix", "logprobs")
    @classmethod
    def _unsupported(cls, value, info):
        fine = value is None or value is False or (info.field_name == "best_of" and value == 1)
        if not fine:
            raise ValueError("is not supported by this server")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str = Field(pattern="^text$")
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str = Field(pattern="^(system|user|assistant|developer)$")
    content: str | list[TextPart]

    def plain(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    tools: list | None = None

    @field_validator("logprobs", "tools")
    @classmethod
    def _unsupported(cls, value):
        if value:
            raise ValueError("is not supported by this server")
        return value
