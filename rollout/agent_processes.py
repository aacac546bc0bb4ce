"""Agent programs in processes of their own (``rollout.agent_processes``), off the engine's core.

A program run in the rollout's process shares its interpreter with the engine's loop: the openai
client's work inside a program (building each request, parsing each reply) costs the rollout's
core about as much as the endpoint does. Here each process serves many episodes at once, as
tasks of one event loop (a plain function's episodes in threads of a pool), their calls reaching
the endpoint through 127.0.0.1 with each episode's key, on the cores ``placement.cores.agent``
names. The rollout sends a process ``("run", key, row)`` and ``("cancel", key)`` when the episode
ends first; the process answers ``("return", key, value)`` or ``("raise", key, error, traceback)``.

A process that dies fails the episodes it held (env_error) and a new one takes the next.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, Callable


class RemoteTraceback(Exception):
    """Where a program failed in its process: the cause of the error its episode reports, so the
    log's traceback shows the program's own frames (as ``multiprocessing.pool`` does)."""

    def __str__(self) -> str:
        return self.args[0]


class ProgramProcess:
    """One process of programs, and the thread of the rollout's that reads its answers."""

    def __init__(self, program: str, base_url: str, deadline_s: float, cores: list[int] | None,
                 deliver: Callable[[str, str, Any], None]) -> None:
        """``deliver(key, kind, value)``: an episode's return ("return", its value) or failure
        ("raise", the error)."""
        # a new interpreter, not a fork (the rollout's engine holds threads a fork would copy) nor
        # multiprocessing's spawn (which imports the rollout's __main__ again); it sees the modules
        # the rollout sees (its sys.path), and is killed with it (its parent's death closes the socket)
        ours, theirs = socket.socketpair()
        arguments = json.dumps({"program": program, "base_url": base_url, "deadline_s": deadline_s,
                                "cores": cores, "path": sys.path, "socket": theirs.fileno()})
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        self.process = subprocess.Popen([sys.executable, "-m", "rollout.agent_processes", arguments],
                                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=environment)
        theirs.close()
        self.connection = Connection(ours.detach())
        self.deliver = deliver
        self.running: set[str] = set()  # keys of its episodes under way
        self.lock = threading.Lock()  # sends come from the rollout's episode threads
        self.alive = True
        threading.Thread(target=self.read, name="agent-process-reader", daemon=True).start()

    def send(self, message: tuple) -> bool:
        with self.lock:
            if not self.alive:
                return False
            if message[0] == "run":
                self.running.add(message[1])
            try:
                self.connection.send(message)
            except (OSError, ValueError):  # it died: read() fails what it held
                return message[0] != "run"
            return True

    def read(self) -> None:
        while True:
            try:
                kind, key, *value = self.connection.recv()
            except (EOFError, OSError):
                break
            with self.lock:
                self.running.discard(key)
            self.deliver(key, kind, value[0] if kind == "return" else _error(*value))
        with self.lock:
            self.alive, held, self.running = False, self.running, set()
        try:
            code = self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = "none: it closed its socket"
        died = RuntimeError(f"the agent programs' process {self.process.pid} exited (code {code}) while it ran "
                            "this episode's program (its error, if it printed one, is in the rollout's log)")
        for key in held:
            self.deliver(key, "raise", died)

    def close(self) -> None:
        with self.lock:
            self.alive = False
        self.connection.close()  # it ends when it reads the end
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5.0)


class ProgramProcesses:
    """``count`` processes of ``program``; each episode's program goes to the one with the fewest
    under way."""

    def __init__(self, count: int, program: str, base_url: str, deadline_s: float, cores: list[int] | None,
                 deliver: Callable[[str, str, Any], None]) -> None:
        self.make = lambda: ProgramProcess(program, base_url, deadline_s, cores, deliver)
        self.processes = [self.make() for _ in range(count)]
        self.lock = threading.Lock()
        self.where: dict[str, ProgramProcess] = {}

    def start(self, key: str, row: dict) -> None:
        with self.lock:
            self.processes = [p if p.alive else self.make() for p in self.processes]
            process = min(self.processes, key=lambda p: len(p.running))
            self.where[key] = process
        if not process.send(("run", key, row)):
            process.deliver(key, "raise", RuntimeError("the agent programs' process exited before it took this "
                                                       "episode"))

    def cancel(self, key: str) -> None:
        """The episode ended first: its program is cancelled (its calls are refused from now on)."""
        with self.lock:
            process = self.where.pop(key, None)
        if process is not None and key in process.running:
            process.send(("cancel", key))

    def close(self) -> None:
        for process in self.processes:
            process.close()


def _error(error: bytes | None, text: str, summary: str) -> BaseException:
    """A program's error as its process raised it (where it pickles; else a RuntimeError saying
    it), its traceback the cause."""
    try:
        raised = pickle.loads(error) if error is not None else RuntimeError(summary)
    except Exception:
        raised = RuntimeError(summary)
    raised.__cause__ = RemoteTraceback(text)
    return raised


# the process's side


def serve(arguments: dict) -> None:
    """A process's life: its episodes' programs, each with a copy of one client of the endpoint
    (the episode's key), until the rollout closes the connection."""
    sys.path[:] = arguments["path"]
    if arguments["cores"]:
        os.sched_setaffinity(0, arguments["cores"])
    from common.functions import load_function

    connection = Connection(arguments["socket"])
    function = load_function(arguments["program"], "rollout.agent")
    asyncio.run(_serve(connection, function, arguments["base_url"], arguments["deadline_s"]))


async def _serve(connection, function, base_url: str, deadline_s: float) -> None:
    from openai import AsyncOpenAI, OpenAI

    loop = asyncio.get_running_loop()
    asynchronous = inspect.iscoroutinefunction(function)
    client = (AsyncOpenAI if asynchronous else OpenAI)(base_url=base_url, api_key="-", max_retries=0,
                                                       timeout=deadline_s)
    threads = None if asynchronous else ThreadPoolExecutor(max_workers=256, thread_name_prefix="agent-program")
    tasks: dict[str, asyncio.Task] = {}
    closed = loop.create_future()

    async def episode(key: str, row: dict) -> None:
        own = client.with_options(api_key=key)
        try:
            run = function(own, row) if asynchronous else loop.run_in_executor(threads, function, own, row)
            _send(connection, ("return", key, await asyncio.wait_for(run, deadline_s)))
        except asyncio.CancelledError:
            pass  # its episode ended: the rollout expects nothing
        except BaseException as error:
            if isinstance(error, asyncio.TimeoutError):
                error = TimeoutError(f"the agent program ran past rollout.agent_deadline_s {deadline_s:g}")
            _send(connection, ("raise", key, *_pickled(error)))
        finally:
            tasks.pop(key, None)

    def readable() -> None:
        try:
            while connection.poll():
                kind, key, *rest = connection.recv()
                if kind == "run":
                    tasks[key] = loop.create_task(episode(key, rest[0]))
                elif key in tasks:
                    tasks[key].cancel()
        except (EOFError, OSError):  # the rollout closed it, or died
            if not closed.done():
                closed.set_result(None)

    loop.add_reader(connection.fileno(), readable)
    await closed
    for task in list(tasks.values()):
        task.cancel()
    if threads is not None:
        threads.shutdown(wait=False, cancel_futures=True)


def _send(connection, message: tuple) -> None:
    try:
        connection.send(message)
    except (pickle.PicklingError, TypeError, AttributeError) as error:  # a return that does not pickle
        connection.send(("raise", message[1], *_pickled(TypeError(
            f"the agent program returned {type(message[2]).__name__}, which does not pickle ({error}): a "
            "reward is a number or a dict of numbers"))))
    except (OSError, ValueError):  # the rollout is gone
        pass


def _pickled(error: BaseException) -> tuple[bytes | None, str, str]:
    """``error`` as it travels: pickled where it can be, its traceback's text, and a line saying it."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    summary = f"{type(error).__name__}: {error}"
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
    except Exception:
        data = None
    return data, text, summary


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
