"""Reward calls: functions named ``"module:function"`` in the config (plain or ``async def``) and an
HTTP reward service (``scorer.reward_url``), each run with a deadline, at most
``scorer.reward_concurrency`` at once, on an event loop of the scorer's own (``RewardCalls``), so a
slow or remote reward never holds up the scorer's loop.

A function names the keywords it wants, out of ``prompt`` and ``response`` (text, decoded with
the policy's tokenizer, special tokens dropped), ``prompt_tokens`` and ``response_tokens`` (ids)
``row`` (the prompt's row of the data file: an ``answer`` to check against) and ``messages`` (an
episode's conversation, a list of ``{"role", "content"}``; None for a single response), or takes
``**kwargs`` for all of them. A call that raises, passes its deadline or returns something that is
not a finite number failed (``Failed``): the scorer counts it by name and error and gives the
sample ``scorer.on_reward_failure``; nothing else of the request is lost.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import math
import threading
from dataclasses import dataclass
from functools import partial
from typing import Any, Awaitable, Callable

from common.functions import load_function

ARGUMENTS = ("prompt", "response", "prompt_tokens", "response_tokens", "row", "messages")
URL_BACKOFF_S = (0.2, 5.0)  # a reward service that answers 5xx or refuses: the first wait, the longest


def wanted_arguments(function: Callable[..., Any]) -> tuple[str, ...]:
    """The arguments ``function`` gets: those of ``ARGUMENTS`` it names (all with ``**kwargs``).
    A parameter it needs that is not one of them is an error; one with a default is left alone."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return ARGUMENTS
    named = [p for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                 inspect.Parameter.KEYWORD_ONLY)]
    unknown = [p.name for p in named if p.name not in ARGUMENTS and p.default is inspect.Parameter.empty]
    if unknown or any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in parameters):
        raise TypeError(f"it asks for {unknown or 'positional-only arguments'}; a reward function gets "
                        f"{', '.join(ARGUMENTS)} by name")
    return tuple(p.name for p in named if p.name in ARGUMENTS)


class NotANumber(ValueError):
    """A reward call answered something that is not a finite number."""


class WrongCount(ValueError):
    """A reward service answered another number of rewards than it was sent samples."""


@dataclass(frozen=True)
class Failed:
    """A reward call that did not give a number: its error's type and text, for the metrics and log."""
    error: str  # the exception's type name: TimeoutError, HTTPStatusError, WrongCount...
    text: str
    exception: BaseException | None = None  # its traceback, logged the first time


def finite(value: Any) -> float:
    """``value`` as a float, or ``NotANumber``."""
    try:
        number = float(value)
    except Exception:  # not a number, an integer past a float (OverflowError), a __float__ that raises
        raise NotANumber(f"returned {str(value)[:100]!r}, not a number") from None
    if not math.isfinite(number):
        raise NotANumber(f"returned {number}")
    return number


@dataclass
class RewardFunction:
    name: str  # the "module:function" spec: how it is named in logs and metrics
    function: Callable[..., Any]
    weight: float
    arguments: tuple[str, ...]  # what it is called with
    per_turn: bool = False

    @staticmethod
    def load(spec: str, weight: float, key: str, per_turn: bool = False) -> "RewardFunction":
        function = load_function(spec, key, check=wanted_arguments)
        return RewardFunction(spec, function, weight, wanted_arguments(function), per_turn)

    def call(self, arguments: dict[str, Any]) -> Callable[[], Any]:
        """The call of it on one sample's ``arguments``, for ``RewardCalls.submit``."""
        return partial(self.function, **{name: arguments[name] for name in self.arguments})


class RemoteReward:
    """``scorer.reward_url``: POSTed a batch, it answers ``{"rewards": [...]}``, one a sample. The
    body holds each sample's prompt, response, messages and row (``samples``), and OpenRLHF's
    ``--remote_rm_url`` fields (``query``: prompt and response as one text, ``prompts``, ``labels``:
    the rows' answers) so services written for it work. A 5xx or a refused connection is tried
    again, backing off, until the call's deadline; any other error fails the call at once."""

    name = "reward_url"

    def __init__(self, url: str, weight: float, concurrency: int) -> None:
        self.url, self.weight, self.concurrency = url, weight, concurrency
        self.client = None  # made in the calls' loop, where it is used: keep-alive connections

    def call(self, batch: list[dict[str, Any]]) -> Callable[[], Awaitable[list[float]]]:
        body = {"samples": [{key: item[key] for key in ("prompt", "response", "messages", "row")} for item in batch],
                "query": [item["sequence"] for item in batch], "prompts": [item["prompt"] for item in batch],
                "labels": [(item["row"] or {}).get("answer") for item in batch]}
        return partial(self._post, json.dumps(body, default=str).encode(), len(batch))

    async def _post(self, body: bytes, count: int) -> list[float]:
        import httpx

        if self.client is None:
            limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
            self.client = httpx.AsyncClient(limits=limits, timeout=None)  # the call's deadline bounds it
        wait = URL_BACKOFF_S[0]
        while True:
            try:
                response = await self.client.post(self.url, content=body, headers={"content-type": "application/json"})
                if response.status_code < 500:
                    break
            except (httpx.ConnectError, httpx.RemoteProtocolError):
                pass
            await asyncio.sleep(wait)
            wait = min(2 * wait, URL_BACKOFF_S[1])
        response.raise_for_status()
        rewards = response.json().get("rewards")
        if not isinstance(rewards, list) or len(rewards) != count:
            raise WrongCount(f"answered {len(rewards) if isinstance(rewards, list) else rewards!r} rewards for "
                             f"{count} samples")
        return [finite(value) for value in rewards]

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()


class RewardCalls:
    """An event loop in a thread of the scorer's own, where reward calls run: ``async def`` ones on
    it, plain ones in its pool of threads (so a plain function may be called from several threads at
    once), at most ``concurrency`` at once, each failing past ``deadline_s``."""

    def __init__(self, concurrency: int, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.loop = asyncio.new_event_loop()
        self.pool = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="reward-call")
        self.semaphore = asyncio.Semaphore(concurrency)
        self.thread = threading.Thread(target=self.loop.run_forever, name="reward-calls", daemon=True)
        self.thread.start()

    def submit(self, call: Callable[[], Any]) -> concurrent.futures.Future:
        """Start ``call`` (a plain function's, or one that returns an awaitable); its future holds
        what it returned, or the error it raised (``TimeoutError`` past the deadline)."""
        return asyncio.run_coroutine_threadsafe(self._guarded(call), self.loop)

    async def _guarded(self, call: Callable[[], Any]) -> Any:
        async with self.semaphore:
            try:
                if inspect.iscoroutinefunction(call):  # it sees through a partial
                    return await asyncio.wait_for(call(), self.deadline_s)
                # a plain call that hangs keeps its thread; the sample goes on without it
                return await asyncio.wait_for(self.loop.run_in_executor(self.pool, partial(_plain, call)),
                                              self.deadline_s)
            except (SystemExit, KeyboardInterrupt, GeneratorExit) as error:  # would end the loop's thread
                raise UserExit(f"raised {type(error).__name__}: {error}") from None

    def close(self, remote: RemoteReward | None = None) -> None:
        """Close the service's connections and stop the loop; what fails here is not the run's error."""
        try:
            if remote is not None:
                asyncio.run_coroutine_threadsafe(remote.aclose(), self.loop).result(timeout=5.0)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5.0)
        self.pool.shutdown(wait=False, cancel_futures=True)


class UserExit(RuntimeError):
    """A reward call raised what ends a thread or a process (SystemExit, KeyboardInterrupt): its
    call failed, the scorer goes on."""


def _plain(call: Callable[[], Any]) -> Any:
    """A plain call in a pool thread, its SystemExit a failure of its own."""
    try:
        return call()
    except (SystemExit, KeyboardInterrupt, GeneratorExit) as error:
        raise UserExit(f"raised {type(error).__name__}: {error}") from None


def unmatched_turns(text: str) -> concurrent.futures.Future:
    """A per-turn call that cannot be made: the episode's turns and its conversation's assistant
    messages do not pair up. A future already failed, as a call's would be."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(TurnsUnmatched(text))
    return future


class TurnsUnmatched(ValueError):
    """An episode's conversation has fewer assistant messages than its token stream has turns."""


def outcome(future: concurrent.futures.Future) -> Any:
    """A finished call's value, or ``Failed`` with its error."""
    if future.cancelled():
        return Failed("CancelledError", "cancelled")
    error = future.exception()
    if error is None:
        return future.result()
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return Failed("TimeoutError", "passed scorer.reward_deadline_s")
    return Failed(type(error).__name__, str(error)[:500], error)
