"""The OpenAI wire format: request bodies, prompt encoding, response and chunk bodies.

Request fields follow the OpenAI API; the extensions are vLLM's names (`top_k`, `ignore_eos`,
`return_token_ids`). Responses are plain dicts of the OpenAI shape plus `spd`: the decode
statistics (cycles, acceptance) of that request.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field

from ..loading import check_utf8
from ..sampling import SamplingParams
from ..stats import SPDStats


class APIError(Exception):
    """An error answered as OpenAI's {"error": {...}} body with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)                  # extension; 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False                      # extension
    return_token_ids: bool = False                # extension: token ids in each choice

    def sampling(self) -> SamplingParams:
        try:
            return SamplingParams(temperature=self.temperature, top_k=max(self.top_k, 0),
                                  top_p=self.top_p, seed=self.seed)
        except ValueError as err:   # the message starts with the field's name
            raise APIError(400, str(err), str(err).split()[0]) from None

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)   # the newer name of max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)           # text, or token ids


def chat_prompt_ids(tokenizer, messages: list[Message]) -> list[int]:
    """Messages -> prompt ids through the model's chat template (as `spd generate --prompt`)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    for i, m in enumerate(messages):
        check_text(m.text(), f"messages[{i}]")
    try:
        text = tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in messages],
                                             tokenize=False, add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 -- templates raise their own errors (e.g. roles must alternate)
        raise APIError(400, f"the model's chat template refused these messages: {err}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def check_text(text: str, param: str) -> None:
    """400 for text that is no valid Unicode (JSON's \\ud800 escapes make lone surrogates)."""
    try:
        check_utf8(text, param)
    except ValueError as err:
        raise APIError(400, str(err), param) from None


def completion_prompt_ids(tokenizer, prompt: str | list[int]) -> list[int]:
    """A text prompt (raw, no chat template: `spd generate --raw`) or token ids -> ids."""
    if isinstance(prompt, list):
        return list(prompt)
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
    check_text(prompt, "prompt")
    return tokenizer.encode(prompt)


def completion_budget(prompt_len: int, asked: int | None, default: int | None, context: int) -> int:
    """Tokens to generate: the asked number, checked against the context, else the default."""
    room = context - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt is {prompt_len} tokens, but this server's context is "
                            f"{context} tokens (prompt plus completion); shorten the prompt", "messages")
    if asked is not None and asked > room:
        raise APIError(400, f"the prompt ({prompt_len} tokens) plus max_tokens ({asked}) is "
                            f"{prompt_len + asked} tokens, beyond this server's context of {context}; "
                            f"ask for at most {room} tokens", "max_tokens")
    return asked if asked is not None else min(default or room, room)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Shape:
    """Response and chunk bodies of one request, for chat or for text completions."""

    def __init__(self, chat: bool, model: str, with_token_ids: bool):
        self.chat, self.model, self.with_token_ids = chat, model, with_token_ids
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, tokens: list[int], finish: str | None, delta: bool) -> dict:
        if not self.chat:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        elif delta:
            choice = {"index": 0, "delta": {} if text is None else {"content": text},
                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish}
        if self.with_token_ids:
            choice["token_ids"] = tokens
        return choice

    def response(self, text: str, tokens: list[int], finish: str, prompt_ids: list[int],
                 stats: SPDStats) -> dict:
        body = self._head("chat.completion" if self.chat else "text_completion")
        body.update(choices=[self._choice(text, tokens, finish, delta=False)],
                    usage=usage(len(prompt_ids), len(tokens)), spd=stats.to_dict())
        if self.with_token_ids:
            body["prompt_token_ids"] = prompt_ids
        return body

    def chunk(self, text: str | None, tokens: list[int], finish: str | None = None) -> dict:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [self._choice(text, tokens, finish, delta=True)]
        return body

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant role (OpenAI does); completions have none."""
        if not self.chat:
            return None
        body = self.chunk("", [])
        body["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return body

    def last_chunk(self, finish: str, prompt_len: int, completion_tokens: int, stats: SPDStats) -> dict:
        body = self.chunk(None if self.chat else "", [], finish)
        body.update(usage=usage(prompt_len, completion_tokens), spd=stats.to_dict())
        return body

    def usage_chunk(self, prompt_len: int, completion_tokens: int) -> dict:
        """OpenAI's stream_options.include_usage: a last chunk with no choices."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=usage(prompt_len, completion_tokens))
        return body
