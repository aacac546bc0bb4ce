"""The rollout's OpenAI-compatible endpoint: chat completions, completions, the Responses API and
the Anthropic Messages API on loopback, for agent programs (``rollout.agent``), answered by the
rollout's own engine (the last two taken as the chat-completions call they amount to:
``environments.agent_apis``).

Each call carries its episode's key (``Authorization: Bearer <key>``, or ``x-api-key``); a key the
rollout did not give, or whose episode has ended, is refused (401, 404), so one episode
never reads another's tokens. The request is vLLM's own ``ChatCompletionRequest`` (validated as
vLLM's server validates it; what an episode's call may not ask for is refused with 400,
``environments.agents.refusal``) and the answer vLLM's ``ChatCompletionResponse``. The handler
hands the call to the episode (``environments.agents.AgentEnvironment.offer``) and awaits its
answer, which the rollout's loop gives once the engine has generated the turn, batched with every
other request.
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

from environments import agent_apis
from environments.agent_apis import CALL_NAMES, ROUTES, Refused, as_chat, episode_key

LOG = logging.getLogger(__name__)  # the rollout's log: its root handler
START_DEADLINE_S = 30.0
KEEP_ALIVE_S = 75.0


@dataclass
class Call:
    """One call waiting for its turn: the request, and where its answer goes: the future of an event
    loop's handler (``Endpoint.respond``), or ``reply`` (``Endpoint.take``)."""
    request: Any  # vllm's ChatCompletionRequest (a Responses or Messages call's too), or its CompletionRequest
    future: asyncio.Future | None
    loop: asyncio.AbstractEventLoop | None
    api: str = "chat"  # environments.agent_apis.ROUTES' names
    asked: Any = None  # a Responses or Messages call's own request (vLLM's type), its answer's shape
    sampling: Any = None  # the run's SamplingConfig, which a Responses API answer reports (its episode sets it)
    reply: Callable[[Any], None] | None = None
    answered: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def completion(self) -> bool:
        """A completions call: a prompt of text or ids, not messages."""
        return self.api == "completions"

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
    """uvicorn serving the routes of ``agent_apis.ROUTES`` in a thread of its own, on 127.0.0.1 and
    a free port. ``lookup(key)``: the episode that key belongs to, or None."""

    def __init__(self, lookup: Callable[[str], Any], host: str = "127.0.0.1", answer_deadline_s: float = 3600.0
                 ) -> None:
        """``answer_deadline_s``: the longest a call waits for its answer (its episode's end answers
        it before; this bounds the wait should nothing else)."""
        from fastapi import FastAPI, Request

        self.lookup, self.answer_deadline_s = lookup, answer_deadline_s
        self.app = app = FastAPI()

        for path, api in ROUTES.items():
            app.add_api_route(path, self._route(api, Request), methods=["POST"])

        # idle connections are kept longer than a client keeps them (httpx: 5 s, uvicorn's default
        # too): else the server may close one as a program sends on it, and the call fails (ReadError)
        self.server, self.thread, self.port = serve_in_thread(app, "openai-endpoint", host, access_log=False,
                                                              timeout_keep_alive=KEEP_ALIVE_S)
        # OpenAI's clients' base URL; Anthropic's client adds /v1 itself (its base URL is ``root_url``)
        self.root_url = f"http://{host}:{self.port}"
        self.base_url = f"{self.root_url}/v1"

    def _route(self, api: str, request_type: type) -> Callable:
        """The route's handler of ``api``'s calls (FastAPI reads its annotation: ``request_type``)."""
        async def route(request: request_type):
            return await self.serve(request, api)
        return route

    async def serve(self, request, api: str) -> Any:
        """One call of any route, through the HTTP server."""
        from fastapi.responses import JSONResponse, StreamingResponse

        status, answer, streamed = await self.respond(episode_key(request.headers), await request.body(), api)
        if streamed:
            return StreamingResponse(iter(answer), media_type="text/event-stream")
        return JSONResponse(answer, status_code=status)

    async def respond(self, key: str, body: bytes, api: str) -> tuple[int, Any, bool]:
        """One call of ``api`` by its episode's ``key``: validated as vLLM's server validates it,
        answered once the policy's turn is generated. (status, the answer's JSON or its stream's
        events, streamed)."""
        loop = asyncio.get_running_loop()
        call, refused = self._admit(key, body, api,
                                    lambda request, asked: Call(request, loop.create_future(), loop, api, asked))
        if refused is not None:
            return refused
        try:
            answer = await asyncio.wait_for(call.future, self.answer_deadline_s)
        except asyncio.TimeoutError:
            answer = HTTPError(504, f"the rollout did not answer this call within {self.answer_deadline_s:g}s")
        return _answered(call, answer)

    def take(self, key: str, body: bytes, api: str, reply: Callable[[int, Any, bool], None]) -> None:
        """``respond`` for a caller with no event loop (a program process's call, read by the thread
        that reads its connection): ``reply(status, answer, streamed)`` once, from the thread that
        answers the call (this one where it is refused)."""
        def made(request, asked) -> Call:
            call = Call(request, None, None, api, asked)
            call.reply = lambda answer: reply(*_answered(call, answer))
            return call

        _, refused = self._admit(key, body, api, made)
        if refused is not None:
            reply(*refused)

    def _admit(self, key: str, body: bytes, api: str, make: Callable[[Any, Any], Call]
               ) -> tuple[Call | None, tuple[int, dict, bool] | None]:
        """The call of ``body``, made by ``make`` from vLLM's chat or completions request (and a
        Responses or Messages call's own) and given to its episode; or why it is refused, as an answer."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.exceptions import VLLMValidationError

        environment = self.lookup(key)
        if environment is None:
            return None, _error(401, "unknown key: each episode calls with the key its program was given")
        try:
            if api in ("chat", "completions"):
                request, asked = (CompletionRequest if api == "completions" else ChatCompletionRequest
                                  ).model_validate_json(body), None
            else:
                request, asked = as_chat(api, body, getattr(environment, "conversations", {}))
        except Refused as refused:
            return None, _error(400, str(refused))
        except (ValidationError, ValueError, VLLMValidationError) as invalid:
            return None, _error(400, f"not {CALL_NAMES[api]} request: {invalid}")
        except Exception as error:  # a converter's own failure on what validated (vLLM's): the call, not the process
            return None, _error(400, f"{CALL_NAMES[api]} request vLLM's converter could not read "
                                     f"({type(error).__name__}: {error})")
        call = make(request, asked)
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


def _answered(call: Call, answer: Any) -> tuple[int, Any, bool]:
    """``_finished``, or a 500 saying why where the answer could not be written: the program's call
    fails as a server's would, it never waits on."""
    try:
        return _finished(call, answer)
    except Exception as error:
        LOG.error("the endpoint could not answer a call", exc_info=error)
        return _error(500, f"the rollout could not answer this call ({type(error).__name__}: {error})")


def _finished(call: Call, answer: Any) -> tuple[int, Any, bool]:
    """A call's ``answer`` (vLLM's response, its JSON, or an ``HTTPError``) as ``respond`` gives it,
    in the call's API: (status, the JSON or the stream's events, streamed)."""
    if isinstance(answer, HTTPError):
        return _error(answer.status, answer.message)
    whole = answer if isinstance(answer, dict) else answer.model_dump(mode="json", exclude_none=True)
    if call.asked is not None:
        whole, events = agent_apis.answer(call.api, call.asked, whole, call.sampling)
        return (200, events, True) if events is not None else (200, whole, False)
    request = call.request
    if not request.stream:
        return 200, whole, False
    usage = bool(request.stream_options and request.stream_options.include_usage)
    events = [f"data: {json.dumps(chunk)}\n\n" for chunk in stream_chunks(whole, call.completion, usage)]
    return 200, [*events, "data: [DONE]\n\n"], True


class InProcess(httpx.AsyncBaseTransport):
    """An async client's calls answered by ``Endpoint.respond`` in the caller's event loop: what the
    HTTP server and its routing would add (a fifth of a call, by py-spy) is left out, and the
    answer is the same bytes."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        api = ROUTES.get(request.url.path)
        if api is None or request.method != "POST":
            return httpx.Response(404, json={"detail": "Not Found"}, request=request)
        return http_response(request, *await self.endpoint.respond(episode_key(request.headers),
                                                                   await request.aread(), api))


def http_response(request: httpx.Request, status: int, answer: Any, streamed: bool) -> httpx.Response:
    """``respond``'s answer as the response to a client transport's ``request``."""
    if streamed:
        return httpx.Response(status, headers={"content-type": "text/event-stream"},
                              content="".join(answer).encode(), request=request)
    return httpx.Response(status, json=answer, request=request)
