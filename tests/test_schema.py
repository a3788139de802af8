"""Request bodies without a server: the token limit against the context, and which validation error a refusal
reports (the server-level battery is tests/test_server_hardening.py)."""

import json

import pytest

from openk3.serve.schema import APIError, ChatBody, CompletionBody, parse_body, sampling_params

CONTEXT, VOCAB = 4096, 260


def body(kind, **fields):
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if kind is ChatBody else \
        {"model": "m", "prompt": "hi"}
    return parse_body(json.dumps(base | fields).encode(), kind, "m")


def refusal(call) -> APIError:
    with pytest.raises(APIError) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("prompt_tokens", [1, 100, CONTEXT - 16, CONTEXT - 1])
def test_default_token_limit_fills_a_chat_and_caps_a_completion(prompt_tokens):
    room = CONTEXT - prompt_tokens
    assert sampling_params(body(ChatBody), CONTEXT, VOCAB, prompt_tokens).max_tokens == room
    assert sampling_params(body(CompletionBody), CONTEXT, VOCAB, prompt_tokens).max_tokens == min(16, room)


@pytest.mark.parametrize("kind", [ChatBody, CompletionBody])
def test_a_token_limit_past_the_context_is_refused(kind):
    room = 96
    assert sampling_params(body(kind, max_tokens=room), CONTEXT, VOCAB, CONTEXT - room).max_tokens == room
    error = refusal(lambda: sampling_params(body(kind, max_completion_tokens=room + 1), CONTEXT, VOCAB,
                                            CONTEXT - room))
    assert (error.status, error.param, error.code) == (400, "max_completion_tokens", "context_length_exceeded")
    assert f"at most {room}" in error.message and "--max-model-len" in error.message
    full = refusal(lambda: sampling_params(body(kind), CONTEXT, VOCAB, CONTEXT))  # no room for one token
    assert (full.status, full.code) == (413, "context_length_exceeded")
    assert full.param == ("messages" if kind is ChatBody else "prompt")


@pytest.mark.parametrize("fields, param, words", [
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"stop": 5}, "stop", "valid string"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages.0.content.0.text",
     "valid string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "data:,"}]}]},
     "messages.0.content.0.image_url", "dictionary"),
    ({"messages": [{"role": "tool"}]}, "messages.0", "a tool message needs content"),
])
def test_the_reported_error_names_the_field_at_fault(fields, param, words):
    kind = ChatBody if "messages" in fields else CompletionBody
    error = refusal(lambda: body(kind, **fields))
    assert (error.status, error.param) == (400, param) and words in error.message, error.message
