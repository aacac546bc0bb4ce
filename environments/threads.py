"""Threads for what would block the rollout's engine loop: an environment's calls (a user's
``reset`` and ``step``, a tool, an OpenEnv session's messages) and closes that may hang."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class _Workers:
    """Daemon threads that take calls one after another: a call goes to an idle one, or to a new one
    when none is idle, so one that hangs past its deadline holds only its own thread (a fixed pool's
    worker would be lost to every later call), none waits for another, and no exit waits for any.
    Reusing them spares the engine's loop a thread's start a call, which it waits for: 10% of the
    loop's time on a tool task with both cores busy (bench/against_trl_tools.py). One idle for
    ``IDLE_S`` ends."""

    IDLE_S = 60.0

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.idle = 0  # threads waiting for a call, less the calls already put for them

    def submit(self, call: Callable[[], None]) -> None:
        with self.lock:
            if self.idle:
                self.idle -= 1
                self.calls.put(call)
                return
        threading.Thread(target=self._serve, args=(call,), daemon=True, name="environment").start()

    def _serve(self, call: Callable[[], None]) -> None:
        while True:
            call()
            call = None  # what the call held (an environment, its result) is not kept while idle
            with self.lock:
                self.idle += 1
            try:
                call = self.calls.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self.lock:  # a call put as the wait ended is this thread's still
                    try:
                        call = self.calls.get_nowait()
                    except queue.Empty:
                        self.idle -= 1
                        return


_WORKERS = _Workers()


def in_thread(function: Callable[..., Any], *arguments: Any) -> Future:
    """``function(*arguments)`` in a daemon thread that runs nothing else meanwhile (``_Workers``)."""
    future: Future = Future()

    def call() -> None:
        try:
            future.set_result(function(*arguments))
        except BaseException as error:  # the environment's failure is its episode's, reported there
            future.set_exception(error)

    _WORKERS.submit(call)
    return future
