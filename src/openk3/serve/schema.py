"""OpenAI request bodies: parsing and validation, and the error object every refusal uses.

`parse_body` turns raw bytes into a validated body or raises `APIError` (a 4xx in OpenAI's shape
{"error": {"message", "type", "param", "code"}} whose `param` names the offending field, dotted for nested
ones: "messages.0.content", "stream_options.include_usage"). It refuses, with 400: bytes that are not JSON
(invalid UTF-8, a syntax error, nesting deeper than Python's parser allows, an integer of more than 4300
digits), a body that is not an object, a string holding a lone UTF-16 surrogate (valid JSON, but not text:
"\\ud800"), a wrong type (no coercion: "5" is not 5, "yes" is not true), an out-of-range value, an OpenAI field
this server does not implement (`UNSUPPORTED`: code "unsupported_parameter", unless it has the value that means
"not used", e.g. `response_format: {"type": "text"}`; null always counts as absent); and with 404 a model this
server does not serve. Any other field is ignored (`extra="ignore"`): OpenAI fields that change nothing here
(`user`, `metadata`, `store`) and fields OpenAI does not define, which clients written for other servers send
(OpenAI itself refuses those; `top_k` and `ignore_eos` are this server's own). It runs on a worker thread with the
tokenizer (api.py), never on the event loop.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from openk3.sampling import LOGIT_BIAS_RANGE, PENALTY_RANGE, SamplingParams

SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # int64, as OpenAI's `seed`
MAX_CHOICES = 128  # OpenAI's limit on `n`
MAX_STOPS = 4  # OpenAI's limit on `stop`
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's legacy completions default for max_tokens
TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")  # a `logit_bias` key
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads pairs valid surrogates; what is left is not text
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # the only way one gets into strictly decoded UTF-8


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    # OpenAI fields this server does not implement -> the values that mean "not used" (accepted, like absence)
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None  # the limit: of a list only
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def token_limit(self) -> tuple[int | None, str]:
        """(the requested limit, the field it came from): max_completion_tokens wins over the older max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def logprob_count(self) -> int | None:
        """Top alternatives to report per token, or None for no logprobs."""
        return None


class CompletionBody(SamplingFields):
    UNSUPPORTED = {"echo": (False,), "suffix": ("",), "best_of": (1,)}

    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=5)  # legacy shape: the sampled token and this many alternatives

    def logprob_count(self) -> int | None:
        return self.logprobs


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageURL(Strict):
    url: str  # a data: URL (openk3.serve.vision checks it)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; every image is resized into one budget


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL


def part_type(part: Any) -> str | None:
    """The content part's class by its "type" (the union's tag; None: no known type)."""
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return {"text": "TextPart", "image_url": "ImagePart"}.get(kind) if isinstance(kind, str) else None


# a part is checked against the member its "type" names only, so an error names that member's field
ContentPart = Annotated[Annotated[TextPart, Tag("TextPart")] | Annotated[ImagePart, Tag("ImagePart")],
                        Discriminator(part_type, custom_error_type="invalid_part_type",
                                      custom_error_message="a content part's type must be 'text' or 'image_url'")]


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # parts in order: openk3.serve.vision.chat_messages; None (or absent) only in an assistant turn, as OpenAI
    # allows for one that carried tool calls: it counts as empty
    content: str | list[ContentPart] | None = None

    @model_validator(mode="after")
    def _content_given(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatBody(SamplingFields):
    UNSUPPORTED = {"tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
                   "parallel_tool_calls": (), "response_format": ({"type": "text"},), "audio": (),
                   "modalities": (["text"],), "prediction": (), "web_search_options": ()}

    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def reported_error(errors: list[dict]) -> dict:
    """The validation error to report: the one deepest in the body (in a union, from the member that matched
    furthest: a part's `image_url.detail`, not "content is not a string"), at equal depth one that is not a type
    mismatch (a list of five stops is too long, not "not a string"), then the first."""
    return max(errors, key=lambda e: ((param_of(e["loc"]) or "").count(".") + 1, not e["type"].endswith("_type")))


def param_of(loc: tuple) -> str | None:
    """The dotted field path of a pydantic error location without the tags it gives union members: "str",
    "list[int]", a model's class name ("prompt.list[int].0" -> "prompt.0")."""
    def is_tag(p) -> bool:
        return isinstance(p, str) and (p in ("str", "int", "float", "bool") or "[" in p or p[:1].isupper())

    return ".".join(str(p) for p in loc if not is_tag(p)) or None


def lone_surrogate_path(data: Any) -> str | None:
    """The dotted path of the first string value holding a lone surrogate, or None (iterative: any depth)."""
    stack: list[tuple[Any, tuple]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and LONE_SURROGATE.search(value):
                return ".".join(map(str, path)) or None
        elif isinstance(value, (dict, list)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend(reversed([(v, (*path, k)) for k, v in items if isinstance(v, (str, dict, list))]))
    return None


def parse_body(raw: bytes, model: type[SamplingFields], model_name: str) -> Any:
    try:
        text = raw.decode("utf-8")  # strict: json.loads(bytes) would let UTF-8-encoded surrogates through
        data = json.loads(text)
    except RecursionError:
        raise APIError(400, "the body is nested too deeply to parse", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    if SURROGATE_ESCAPE.search(text) and (where := lone_surrogate_path(data)) is not None:
        raise APIError(400, f"{where}: the string holds a lone UTF-16 surrogate, which is not valid Unicode", where,
                       "invalid_value")
    for name, unused in model.UNSUPPORTED.items():
        value = data.get(name)
        if value is not None and not any(type(value) is type(u) and value == u for u in unused):
            raise APIError(400, f"{name} is not supported by this server", name, "unsupported_parameter")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        error = reported_error(exc.errors())
        param, message = param_of(error["loc"]), error["msg"].removeprefix("Value error, ")  # a validator's own words
        raise APIError(400, f"{param}: {message}" if param else message, param, "invalid_value") from None
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", "stream_options", "invalid_value")
    if isinstance(body, ChatBody) and body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    if body.model != model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}", "model",
                       "model_not_found")
    return body


def logit_bias(body: SamplingFields, vocab: int) -> dict[int, float]:
    """`logit_bias` as token id -> bias; every key a token id below `vocab`, every bias in LOGIT_BIAS_RANGE."""
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not TOKEN_ID.fullmatch(key) or int(key) >= vocab:
            raise APIError(400, f"logit_bias: {key!r} is not a token id in [0, {vocab})", "logit_bias",
                           "invalid_value")
        if not LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1]:
            raise APIError(400, f"logit_bias: the bias of {key} must be in {list(LOGIT_BIAS_RANGE)}, got {value}",
                           "logit_bias", "invalid_value")
        bias[int(key)] = value
    return bias


def sampling_params(body: SamplingFields, context: int, vocab: int, prompt_tokens: int) -> SamplingParams:
    """The engine's parameters for the request's first choice (`n` choices differ only in their seed). The token
    limit is max_completion_tokens, else max_tokens; without either, chat replies may fill the context after the
    prompt (as OpenAI's and vLLM's), completions take OpenAI's legacy default of 16 (up to the context). A limit
    that the prompt leaves no room for is refused (400), as OpenAI and vLLM refuse it, and a prompt that fills the
    context (413). `vocab`: the sampled ids."""
    max_tokens, param = body.token_limit()
    room = context - prompt_tokens
    if room < 1:
        raise APIError(413, f"the prompt has {prompt_tokens} tokens; a sequence holds {context} (--max-model-len)",
                       "messages" if isinstance(body, ChatBody) else "prompt", "context_length_exceeded")
    if max_tokens is None:
        max_tokens = room if isinstance(body, ChatBody) else min(DEFAULT_COMPLETION_TOKENS, room)
    elif not 1 <= max_tokens <= context:
        raise APIError(400, f"{param} must be in [1, {context}], got {max_tokens}", param, "invalid_value")
    elif max_tokens > room:
        raise APIError(400, f"{param} {max_tokens} and the prompt's {prompt_tokens} tokens exceed the context of "
                            f"{context} tokens (--max-model-len): at most {room} can follow this prompt", param,
                       "context_length_exceeded")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                          seed=body.seed, stop=[s for s in stop if s], ignore_eos=body.ignore_eos,
                          presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                          logit_bias=logit_bias(body, vocab), logprobs=body.logprob_count())
