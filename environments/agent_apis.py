"""The Responses API (``/v1/responses``) and the Anthropic Messages API (``/v1/messages``) on the
rollout's endpoint: each call taken as the chat-completions call it amounts to, and the turn's
answer given back in the call's own API.

A call of either is converted to vLLM's ``ChatCompletionRequest`` by vLLM's own converters
(``construct_input_messages`` and ``construct_tool_dicts`` for the Responses API,
``AnthropicServingMessages.to_chat_completion_request`` for Anthropic's), so it is refused, recorded
and rendered with the policy's chat template exactly as a chat-completions call is: one episode
is one token stream whatever API its program speaks. The answer, vLLM's ``ChatCompletionResponse``,
becomes vLLM's ``ResponsesResponse`` or ``AnthropicMessagesResponse``; a streamed call gets the
whole turn as that API's events (the turn is generated before it is answered, as for chat).

``previous_response_id`` names a response of the same episode: the conversation through it is the
episode's (``AgentEnvironment.conversations``, kept by ``remember``), its function calls and the
system messages it sent included; the instructions that response was given alone do not carry over,
as OpenAI's API says (vLLM's own store keeps a response's text alone, and drops every system
message).
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

# the path of each API's route, and its name in Call.api
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
          "/v1/messages": "messages"}
CALL_NAMES = {"chat": "a chat-completions", "completions": "a completions", "responses": "a Responses API",
              "messages": "an Anthropic Messages API"}  # as a refusal names a call of each
# a Responses API answer's conversation (its messages through the reply) and the instructions it was
# given, by response id
Conversations = dict[str, tuple[list[dict], "str | None"]]


class Refused(ValueError):
    """A call its API's request type takes but an episode may not make: why, for a 400."""


def episode_key(headers) -> str:
    """The episode's key a call carries: ``Authorization: Bearer <key>`` (OpenAI's clients) or
    ``x-api-key`` (Anthropic's)."""
    bearer = headers.get("authorization", "").removeprefix("Bearer ").strip()
    return bearer or headers.get("x-api-key", "").strip()


def as_chat(api: str, body: bytes, conversations: Conversations):
    """``body`` of a ``responses`` or ``messages`` call as (vLLM's ``ChatCompletionRequest``, the
    API's own request). ``conversations``: the episode's, by response id. Raises pydantic's or
    vLLM's validation errors, or ``Refused``."""
    if api == "responses":
        return _responses_as_chat(body, conversations)
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    asked = AnthropicMessagesRequest.model_validate_json(body)
    return AnthropicServingMessages.to_chat_completion_request(asked), asked


def _responses_as_chat(body: bytes, conversations: Conversations):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts

    asked = ResponsesRequest.model_validate_json(body)
    others = sorted({tool.type for tool in asked.tools if tool.type != "function"})
    if others:
        raise Refused(f"tools of type {', '.join(others)}: an episode's turn calls the program's function tools "
                      "alone (the program runs its tools itself)")
    if asked.background:
        raise Refused("background: an episode's call waits for its turn")
    if asked.text is not None and asked.text.format is not None and asked.text.format.type != "text":
        raise Refused(f"text.format {asked.text.format.type}: the run samples each turn as sampling says, with "
                      "no formats of a call's own")
    history: list[dict] = []
    if asked.previous_response_id is not None:
        if asked.previous_response_id not in conversations:
            raise Refused(f"previous_response_id {asked.previous_response_id}: no response of this episode has "
                          "that id (a response is kept for its episode alone)")
        history, instructions = conversations[asked.previous_response_id]
        if instructions and history[:1] == [{"role": "system", "content": instructions}]:
            history = history[1:]
    messages = [*([{"role": "system", "content": asked.instructions}] if asked.instructions else []), *history,
                *construct_input_messages(request_input=asked.input)]
    # the fields a chat call shares; those left unset keep the chat request's defaults, which refusal reads
    shared = {key: getattr(asked, key) for key in (
        "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "seed", "stop", "stop_token_ids", "ignore_eos", "structured_outputs", "parallel_tool_calls")
        if getattr(asked, key) is not None}
    if not isinstance(asked.tool_choice, str):  # a named tool, allowed tools, a hosted tool: all force a choice
        raise Refused(f"tool_choice {asked.tool_choice.type}: the policy calls a tool or not as it samples; only "
                      "auto (and none) are served")
    chat = ChatCompletionRequest.model_validate({
        **shared, "model": asked.model, "messages": messages,
        "tools": construct_tool_dicts(asked.tools, asked.tool_choice),
        "tool_choice": asked.tool_choice if asked.tools else None,
        "max_completion_tokens": asked.max_output_tokens,
        "logprobs": "message.output_text.logprobs" in (asked.include or []) or bool(asked.top_logprobs),
        "top_logprobs": asked.top_logprobs or None})
    return chat, asked


def remember(call, conversations: Conversations, conversation: list[dict]) -> None:
    """``conversation`` (the messages through ``call``'s answer, as the episode compares them) kept
    for a later ``previous_response_id`` where ``call`` is a Responses API call; before the answer
    goes, since the program's next call may name it at once."""
    if call.api == "responses":
        conversations[call.asked.request_id] = (list(conversation), call.asked.instructions)


def unfit(api: str, tool_calls: list) -> str | None:
    """Why ``api``'s answer cannot carry a turn's ``tool_calls`` (vLLM's ``ToolCall``s) as calls, or
    None: an Anthropic ``tool_use`` block's input is a JSON object, where a parser reads any JSON
    value as a call's arguments. Such a turn is answered as its text, a malformed call."""
    if api != "messages":
        return None
    for call in tool_calls:
        try:
            fits = isinstance(json.loads(call.function.arguments), dict)
        except (TypeError, ValueError):
            fits = False
        if not fits:
            return (f"malformed tool call: the arguments of {call.function.name} are not a JSON object, as a "
                    "tool_use block's input is")
    return None


def answer(api: str, asked, whole: dict, sampling=None) -> tuple[Any, list[str] | None]:
    """A turn's answer (a ``ChatCompletionResponse``'s JSON) as ``api``'s answer to ``asked``: (its
    JSON, or None where streamed; the stream's events, or None). ``sampling``: the run's
    ``SamplingConfig``, which a response reports (None: the call's own figures)."""
    if api == "responses":
        response = _response(asked, whole, sampling)
        return (None, _response_events(response)) if asked.stream else (response, None)
    message = _message(whole)
    return (None, _message_events(message)) if asked.stream else (message, None)


def _response(asked, whole: dict, sampling) -> dict:
    """vLLM's ``ResponsesResponse`` to ``asked`` of the turn in ``whole``, as JSON."""
    from vllm.entrypoints.generate.base.protocol import FunctionCall
    from vllm.entrypoints.openai.responses.protocol import (InputTokensDetails, OutputTokensDetails,
                                                            ResponsesResponse, ResponseUsage)
    from vllm.entrypoints.openai.responses.utils import build_response_output_items

    choice, usage = whole["choices"][0], whole.get("usage") or {}
    message = choice["message"]
    calls = [FunctionCall(id=call["id"], name=call["function"]["name"], arguments=call["function"]["arguments"])
             for call in message.get("tool_calls") or []]
    logprobs = None
    if choice.get("logprobs"):
        from openai.types.responses.response_output_text import Logprob

        logprobs = [Logprob(token=entry["token"], logprob=entry["logprob"], bytes=entry.get("bytes") or [],
                            top_logprobs=[]) for entry in choice["logprobs"]["content"]]
    output = build_response_output_items(message.get("reasoning"), message.get("content"), calls, logprobs,
                                         asked.tools)
    # the run's sampling, as the response reports it (a call cannot change it: refusal); the bound of
    # a turn the call left unbounded is the run's, set after (from_request takes a number)
    run = SimpleNamespace(temperature=_reported(sampling, asked, "temperature"),
                          top_p=_reported(sampling, asked, "top_p"),
                          max_tokens=asked.max_output_tokens or 0, presence_penalty=0.0, frequency_penalty=0.0,
                          logprobs=asked.top_logprobs)
    figures = ResponseUsage(input_tokens=usage.get("prompt_tokens", 0), output_tokens=usage.get("completion_tokens", 0),
                            total_tokens=usage.get("total_tokens", 0),
                            input_tokens_details=InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
                            output_tokens_details=OutputTokensDetails(reasoning_tokens=0))
    response = ResponsesResponse.from_request(
        asked, run, asked.model or "policy", int(time.time()), output,
        "incomplete" if choice["finish_reason"] == "length" else "completed", usage=figures)
    response.max_output_tokens = asked.max_output_tokens
    return response.model_dump(mode="json", exclude_none=True)


def _reported(sampling, asked, key: str) -> float:
    """The run's ``key`` (temperature, top_p), else the call's, else OpenAI's default (1)."""
    for source in (sampling, asked):
        if getattr(source, key, None) is not None:
            return getattr(source, key)
    return 1.0


def _response_events(response: dict) -> list[str]:
    """A whole ``response`` as the Responses API streams one: created, each output item added, its
    text or arguments in one delta, done, then completed (or incomplete)."""
    events: list[dict] = []
    pending = {**response, "status": "in_progress", "output": []}
    events += [{"type": "response.created", "response": pending}, {"type": "response.in_progress",
                                                                    "response": pending}]
    for index, item in enumerate(response["output"]):
        where = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": {**item, "status": "in_progress", "content": []}})
            for number, part in enumerate(item["content"]):
                at = {**where, "content_index": number}
                events += [{"type": "response.content_part.added", **at, "part": {**part, "text": ""}},
                           {"type": "response.output_text.delta", **at, "delta": part["text"],
                            "logprobs": part.get("logprobs") or []},
                           {"type": "response.output_text.done", **at, "text": part["text"],
                            "logprobs": part.get("logprobs") or []},
                           {"type": "response.content_part.done", **at, "part": part}]
        elif item["type"] == "function_call":
            events += [{"type": "response.output_item.added", "output_index": index,
                        "item": {**item, "status": "in_progress", "arguments": ""}},
                       {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
                       {"type": "response.function_call_arguments.done", **where, "name": item["name"],
                        "arguments": item["arguments"]}]
        else:  # reasoning
            text = "".join(part["text"] for part in item.get("content") or [])
            events += [{"type": "response.output_item.added", "output_index": index, "item": {**item, "content": []}},
                       {"type": "response.reasoning_text.delta", **where, "content_index": 0, "delta": text},
                       {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text}]
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": f"response.{response['status']}", "response": response})
    return [f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': number})}\n\n"
            for number, event in enumerate(events)]


def _message(whole: dict) -> dict:
    """vLLM's ``AnthropicMessagesResponse`` of the turn in ``whole``, as JSON."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    # messages_full_converter reads nothing of its server: called as a function of the response
    converted = AnthropicServingMessages.messages_full_converter(None, ChatCompletionResponse.model_validate(whole))
    return converted.model_dump(mode="json", exclude_none=True)


def _message_events(message: dict) -> list[str]:
    """A whole ``message`` as the Messages API streams one: message_start, each content block
    started, its text, thinking or input in one delta, stopped, then message_delta (the stop
    reason) and message_stop."""
    deltas = {"text": lambda block: {"type": "text_delta", "text": block["text"]},
              "thinking": lambda block: {"type": "thinking_delta", "thinking": block["thinking"]},
              "tool_use": lambda block: {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}}
    empty = {"text": {"text": ""}, "thinking": {"thinking": ""}, "tool_use": {"input": {}}}
    usage = message["usage"]
    events = [{"type": "message_start", "message": {**message, "content": [], "stop_reason": None,
                                                    "usage": {**usage, "output_tokens": 0}}}]
    for index, block in enumerate(message["content"]):
        events += [{"type": "content_block_start", "index": index, "content_block": {**block, **empty[block["type"]]}},
                   {"type": "content_block_delta", "index": index, "delta": deltas[block["type"]](block)}]
        if block["type"] == "thinking":
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": block.get("signature", "")}})
        events.append({"type": "content_block_stop", "index": index})
    events += [{"type": "message_delta", "delta": {"stop_reason": message.get("stop_reason"),
                                                   "stop_sequence": message.get("stop_sequence")},
                "usage": {"output_tokens": usage["output_tokens"]}},
               {"type": "message_stop"}]
    return [f"event: {event['type']}\ndata: {json.dumps(event)}\n\n" for event in events]
