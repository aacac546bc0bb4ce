"""The rollout's OpenAI-compatible endpoint: chat completions and completions on loopback, for
agent programs (``rollout.agent``), answered by the rollout's own engine.

Each call carries its episode's key (``Authorization: Bearer <key>``); a key the rollout did not
give, or whose episode has ended, is refused (401, 404), so one episode never reads another's
tokens. The request is vLLM's own ``ChatCompletionRequest`` (validated as vLLM's server validates
it; what an episode's call may not ask for is refused with 400, ``environments.agents.refusal``) and
the answer vLLM's ``ChatCompletionResponse``. The handler hands the call to the episode
(``environments.agents.AgentEnvironment.offer``) and awaits its answer, which the rollout's loop gives
once the engine has generated the turn, batched with every other request.
"""

# no `from __future__ import annotations`: FastAPI reads the route's annotations at runtime
import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

LOG = logging.getLogger(__name__)  # the rollout's log: its root handler
START_DEADLINE_S = 30.0
KEEP_ALIVE_S = 75.0


@dataclass
class Call:
    """One chat-completions call waiting for its turn: the request, and where its answer goes: the
    future of an event loop's handler (``Endpoint.respond``), or ``reply`` (``Endpoint.take``)."""
    request: Any  # vllm's ChatCompletionRequest, or its CompletionRequest
    future: asyncio.Future | None
    loop: asyncio.AbstractEventLoop | None
    completion: bool = False  # a completions call: a prompt of text or ids, not messages
    reply: Callable[[Any], None] | None = None
    answered: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, response: Any) -> None:
        """From any thread: the call's answer (a ``ChatCompletionResponse`` or its JSON, or an
        ``HTTPError``); the first one counts."""
        if self.reply is None:
            self.loop.call_soon_threadsafe(lambda: self.future.done() or self.future.set_result(response))
            return
        with self.lock:
            first, self.answered = not self.answered, True
        if first:
            self.reply(response)


def stream_chunks(answer: dict, completion: bool, usage: bool) -> list[dict]:
    """A whole answer (a chat completion's or a completion's JSON) as the chunks of a stream: the
    turn is generated before it is answered, so it streams as one chunk with all of it, one with
    the finish reason, and the token counts where the call asked for them (``include_usage``)."""
    head = {key: answer[key] for key in ("id", "created", "model")}
    head["object"] = "text_completion" if completion else "chat.completion.chunk"
    chunks = []
    for choice in answer["choices"]:
        body = {key: value for key, value in choice.items() if key not in ("message", "finish_reason")}
        if not completion:
            delta = dict(choice["message"])
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta.get("tool_calls") or [])]
            body = {**body, "delta": delta}
        chunks.append({**head, "choices": [{**body, "finish_reason": None}]})
        last = {"index": choice["index"], "finish_reason": choice["finish_reason"]}
        chunks.append({**head, "choices": [{**last, "text": ""} if completion else {**last, "delta": {}}]})
    if usage:
        chunks.append({**head, "choices": [], "usage": answer.get("usage")})
    return chunks


def serve_in_thread(app, name: str, host: str = "127.0.0.1", **options):
    """``app`` served by uvicorn in a daemon thread of its own on ``host`` and a free port, started
    within START_DEADLINE_S: (the server, whose ``should_exit = True`` stops it, its thread, its
    port). ``options``: uvicorn's ``Config``'s own."""
    import uvicorn

    from protocol.transport import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                           **options))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_DEADLINE_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the {name} server did not start on {host}:{port}")
        time.sleep(0.01)
    return server, thread, port


@dataclass
class HTTPError:
    status: int
    message: str


class Endpoint:
    """uvicorn serving the chat-completions and completions routes in a thread of its own, on
    127.0.0.1 and a free port. ``lookup(key)``: the episode that key belongs to, or None."""

    def __init__(self, lookup: Callable[[str], Any], host: str = "127.0.0.1", answer_deadline_s: float = 3600.0
                 ) -> None:
        """``answer_deadline_s``: the longest a call waits for its answer (its episode's end answers
        it before; this bounds the wait should nothing else)."""
        from fastapi import FastAPI, Request

        self.lookup, self.answer_deadline_s = lookup, answer_deadline_s
        self.app = app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self.serve(request, completion=False)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self.serve(request, completion=True)

        # idle connections are kept longer than a client keeps them (httpx: 5 s, uvicorn's default
        # too): else the server may close one as a program sends on it, and the call fails (ReadError)
        self.server, self.thread, self.port = serve_in_thread(app, "openai-endpoint", host, access_log=False,
                                                              timeout_keep_alive=KEEP_ALIVE_S)
        self.base_url = f"http://{host}:{self.port}/v1"

    async def serve(self, request, completion: bool) -> Any:
        """One call of either route, through the HTTP server."""
        from fastapi.responses import JSONResponse, StreamingResponse

        status, answer, streamed = await self.respond(request.headers.get("authorization", ""), await request.body(),
                                                      completion)
        if streamed:
            return StreamingResponse(iter(answer), media_type="text/event-stream")
        return JSONResponse(answer, status_code=status)

    async def respond(self, authorization: str, body: bytes, completion: bool) -> tuple[int, Any, bool]:
        """One call: its episode's by its key, validated as vLLM's server validates it, answered once
        the policy's turn is generated. (status, the answer's JSON or its stream's events, streamed)."""
        loop = asyncio.get_running_loop()
        call, refused = self._admit(authorization, body, completion,
                                    lambda request: Call(request, loop.create_future(), loop, completion))
        if refused is not None:
            return refused
        try:
            answer = await asyncio.wait_for(call.future, self.answer_deadline_s)
        except asyncio.TimeoutError:
            answer = HTTPError(504, f"the rollout did not answer this call within {self.answer_deadline_s:g}s")
        return _finished(call.request, completion, answer)

    def take(self, authorization: str, body: bytes, completion: bool,
             reply: Callable[[int, Any, bool], None]) -> None:
        """``respond`` for a caller with no event loop (a program process's call, read by the thread
        that reads its connection): ``reply(status, answer, streamed)`` once, from the thread that
        answers the call (this one where it is refused)."""
        def answered(request, answer: Any) -> None:
            try:
                reply(*_finished(request, completion, answer))
            except Exception as error:  # the program must not wait on: its call fails as the server's would
                LOG.error("the endpoint could not answer a call", exc_info=error)
                reply(*_error(500, f"the rollout could not answer this call ({type(error).__name__}: {error})"))

        def made(request) -> Call:
            return Call(request, None, None, completion, reply=lambda answer: answered(request, answer))

        _, refused = self._admit(authorization, body, completion, made)
        if refused is not None:
            reply(*refused)

    def _admit(self, authorization: str, body: bytes, completion: bool, make: Callable[[Any], Call]
               ) -> tuple[Call | None, tuple[int, dict, bool] | None]:
        """The call of ``body``, made by ``make`` from vLLM's request and given to its episode; or
        why it is refused, as an answer."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.exceptions import VLLMValidationError

        environment = self.lookup(authorization.removeprefix("Bearer ").strip())
        if environment is None:
            return None, _error(401, "unknown key: each episode calls with the key its program was given")
        try:
            request = (CompletionRequest if completion else ChatCompletionRequest).model_validate_json(body)
        except (ValidationError, ValueError, VLLMValidationError) as invalid:
            return None, _error(400, f"not a {'completions' if completion else 'chat-completions'} request: "
                                     f"{invalid}")
        call = make(request)
        refused = environment.offer(call)
        return (None, _error(refused.status, refused.message)) if refused is not None else (call, None)

    def transport(self) -> "InProcess":
        """A client transport that reaches this endpoint from this process without HTTP."""
        return InProcess(self)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5.0)


def _error(status: int, message: str) -> tuple[int, dict, bool]:
    """A refusal as ``respond`` answers it."""
    return status, {"error": {"message": message, "type": "invalid_request_error", "code": status}}, False


def _finished(request, completion: bool, answer: Any) -> tuple[int, Any, bool]:
    """A call's ``answer`` (vLLM's response, its JSON, or an ``HTTPError``) as ``respond`` gives it:
    (status, the JSON or the stream's events, streamed)."""
    if isinstance(answer, HTTPError):
        return _error(answer.status, answer.message)
    whole = answer if isinstance(answer, dict) else answer.model_dump(mode="json", exclude_none=True)
    if not request.stream:
        return 200, whole, False
    usage = bool(request.stream_options and request.stream_options.include_usage)
    events = [f"data: {json.dumps(chunk)}\n\n" for chunk in stream_chunks(whole, completion, usage)]
    return 200, [*events, "data: [DONE]\n\n"], True


class InProcess(httpx.AsyncBaseTransport):
    """An async client's calls answered by ``Endpoint.respond`` in the caller's event loop: what the
    HTTP server and its routing would add (a fifth of a call, by py-spy) is left out, and the
    answer is the same bytes."""

    ROUTES = {"/v1/chat/completions": False, "/v1/completions": True}  # the path, and whether it is completions

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        completion = self.ROUTES.get(request.url.path)
        if completion is None or request.method != "POST":
            return httpx.Response(404, json={"detail": "Not Found"}, request=request)
        return http_response(request, *await self.endpoint.respond(request.headers.get("authorization", ""),
                                                                   await request.aread(), completion))


def http_response(request: httpx.Request, status: int, answer: Any, streamed: bool) -> httpx.Response:
    """``respond``'s answer as the response to a client transport's ``request``."""
    if streamed:
        return httpx.Response(status, headers={"content-type": "text/event-stream"},
                              content="".join(answer).encode(), request=request)
    return httpx.Response(status, json=answer, request=request)
