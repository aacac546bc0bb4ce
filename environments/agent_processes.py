"""Agent programs in processes of their own (``rollout.agent_processes``), off the engine's core.

A program run in the rollout's process shares its interpreter with the engine's loop: the openai
client's work inside a program (building each request, parsing each reply) costs the rollout's
core about as much as the endpoint does. Here each process serves many episodes at once, as
tasks of one event loop (a plain function's episodes in threads of a pool), on the cores
``placement.cores.agent`` names. An async program's calls come over the process's connection to
the rollout (``OverConnection``), answered by the endpoint (``Endpoint.take``) with no HTTP on either
side; a plain function's reach the endpoint through 127.0.0.1. Each call carries its episode's
key. A program that blocks its process's loop (a tool called without await) holds up every
episode of that process, not its own alone, as it would in the threads of the rollout's.

The messages are ``protocol``'s (``program_run``, ``program_cancel`` and ``program_answer`` to a
process; ``program_call``, ``program_return`` and ``program_raise`` from it: declared in
``protocol.schema``), one msgpack envelope a frame, each checked on receipt; here a message is
the dict ``{"kind": "run", "key": ..., <its fields>}`` (``pack``, ``unpack``). A process that dies,
or sends what is not such a message, fails the episodes it held (env_error) and a new one takes
the next.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, Callable

import httpx

from environments.agent_apis import ROUTES, episode_key
from environments.interface import PastDeadline
from environments.program_runs import episode_client, within
from protocol.codec import ProtocolError, decode, encode


class RemoteTraceback(Exception):
    """Where a program failed in its process: the cause of the error its episode reports, so the
    log's traceback shows the program's own frames (as ``multiprocessing.pool`` does)."""

    def __str__(self) -> str:
        return self.args[0]


class ProgramError(RuntimeError):
    """A program's error in its process: its type and message; ``where`` (its file and line) keys
    the rollout's failure log, as a local error's last frame does."""

    def __init__(self, error: dict) -> None:
        super().__init__(f"{error['type']}: {error['message']}")
        self.where = tuple(error.get("where") or ())
        self.__cause__ = RemoteTraceback(error.get("traceback") or "")


class ProgramProcess:
    """One process of programs, the thread of the rollout's that writes to it and the one that
    reads its answers and its programs' calls (a process whose loop is stuck stops reading: only
    the writer waits on it)."""

    def __init__(self, program: str, base_url: str, deadline_s: float, cores: list[int] | None,
                 deliver: Callable[[str, str, Any], None], answer: Callable[[dict, Callable[[dict], None]], None]
                 ) -> None:
        """``deliver(key, kind, value)``: an episode's return ("return", its value) or failure
        ("raise", the error); ``answer(call, send)``: a program's call message answered, the
        answer message given to ``send`` once the turn is generated."""
        # a new interpreter, not a fork (the rollout's engine holds threads a fork would copy) nor
        # multiprocessing's spawn (which imports the rollout's __main__ again); it sees the modules
        # the rollout sees (its sys.path), and ends with it (its parent's death closes the socket)
        ours, theirs = socket.socketpair()
        arguments = json.dumps({"program": program, "base_url": base_url, "deadline_s": deadline_s,
                                "cores": cores, "path": sys.path, "socket": theirs.fileno()})
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        self.process = subprocess.Popen([sys.executable, "-m", "environments.agent_processes", arguments],
                                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=environment)
        theirs.close()
        self.connection = Connection(ours.detach())
        self.deliver, self.answer = deliver, answer
        self.running: set[str] = set()  # keys of its episodes under way
        self.lock = threading.Lock()  # running and alive, from the episodes' threads and the reader
        self.alive = True
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # messages for the writer; None ends it
        threading.Thread(target=self.write, name="agent-process-writer", daemon=True).start()
        threading.Thread(target=self.read, name="agent-process-reader", daemon=True).start()

    def run(self, key: str, row: dict) -> bool:
        """``key``'s program on ``row``; False where this process is gone."""
        with self.lock:
            if not self.alive:
                return False
            self.running.add(key)
        self.outbox.put({"kind": "run", "key": key, "row": row})
        return True

    def cancel(self, key: str) -> None:
        with self.lock:
            if key not in self.running:
                return
            self.running.discard(key)  # a cancelled program answers nothing
        self.outbox.put({"kind": "cancel", "key": key})

    def write(self) -> None:
        while (message := self.outbox.get()) is not None:
            try:
                data = pack(message)
            except UNPACKABLE as error:  # a row or an answer no message holds: its episode fails, the process serves on
                self._unsent(message, error)
                continue
            try:
                self.connection.send_bytes(data)
            except (OSError, ValueError):  # it died: the reader fails what it held
                return

    def _unsent(self, message: dict, error: Exception) -> None:
        why = f"{type(error).__name__}: {error}"
        if message["kind"] == "run":
            with self.lock:
                self.running.discard(message["key"])
            self.deliver(message["key"], "raise", TypeError(f"the episode's data row cannot go to its program's "
                                                            f"process ({why})"))
        elif message["kind"] == "answer":  # the program's call is answered all the same
            self.outbox.put({**message, "status": 500, "streamed": False,
                             "answer": {"detail": f"the rollout's answer cannot go to the program's process ({why})"}})

    def read(self) -> None:
        why = None
        while True:
            try:
                message = unpack(self.connection.recv_bytes(), ("return", "raise", "call"))
            except (EOFError, OSError):
                break
            except ProtocolError as error:  # not a message of this protocol: it cannot be trusted
                why = f"it sent what is not an answer ({error})"
                break
            if message["kind"] == "call":
                self.answer(message, self.outbox.put)  # never raises: a checked call is answered
                continue
            with self.lock:
                if message["key"] not in self.running:
                    continue  # cancelled: its episode ended first
                self.running.discard(message["key"])
            value = message["value"] if message["kind"] == "return" else _raised(message["error"])
            self.deliver(message["key"], message["kind"], value)
        with self.lock:
            self.alive, held, self.running = False, self.running, set()
        self.outbox.put(None)
        if why is not None:
            self.process.kill()
        code = self._end()
        self.connection.close()  # here, not by close(): no other thread reads it now
        died = RuntimeError(f"the agent programs' process {self.process.pid} {why or f'exited (code {code})'} while "
                            "it ran this episode's program (its own error, if it printed one, is in the rollout's log)")
        for key in held:
            self.deliver(key, "raise", died)

    def _end(self) -> int | None:
        """The process ended (killed where it has not): its exit code."""
        try:
            return self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=5.0)

    def close(self) -> None:
        with self.lock:
            self.alive = False
        self.outbox.put(None)
        self.process.kill()  # the run is over: its programs' episodes have ended (the reader sees it end)
        self.process.wait(timeout=5.0)


class ProgramProcesses:
    """``count`` processes of ``program``; each episode's program goes to the one with the fewest
    under way."""

    def __init__(self, count: int, program: str, base_url: str, deadline_s: float, cores: list[int] | None,
                 deliver: Callable[[str, str, Any], None], take) -> None:
        """``take``: the endpoint's (``Endpoint.take``), which answers the programs' calls."""
        self.take = take
        self.make = lambda: ProgramProcess(program, base_url, deadline_s, cores, deliver, self.answer)
        self.deliver = deliver
        self.lock = threading.Lock()
        self.processes = [self.make() for _ in range(count)]
        self.where: dict[str, ProgramProcess] = {}
        self.closed = False

    def start(self, key: str, row: dict) -> None:
        with self.lock:
            if self.closed:  # a reset that outlived the run
                process = None
            else:
                self.processes = [p if p.alive else self.make() for p in self.processes]
                process = min(self.processes, key=lambda p: len(p.running))
                self.where[key] = process
        if process is None or not process.run(key, row):
            self.deliver(key, "raise", RuntimeError("the agent programs' process was gone before it took this "
                                                    "episode"))

    def cancel(self, key: str) -> None:
        """The episode ended first: its program is cancelled (its calls are refused from now on)."""
        with self.lock:
            process = self.where.pop(key, None)
        if process is not None:
            process.cancel(key)

    def answer(self, call: dict, send: Callable[[dict], None]) -> None:
        """A program's ``call`` message answered by the endpoint, its answer message to ``send``."""
        def reply(status: int, answer: Any, streamed: bool = False) -> None:
            send({"kind": "answer", "key": call["key"], "id": call["id"], "status": status, "answer": answer,
                  "streamed": streamed})

        api = ROUTES.get(call["path"])
        if api is None:
            return reply(404, {"detail": "Not Found"})
        self.take(call["key"], call["body"].encode(), api, reply)

    def close(self) -> None:
        with self.lock:
            self.closed, processes = True, list(self.processes)
        for process in processes:
            process.close()


# what ``pack`` raises for a message it cannot hold
UNPACKABLE = (TypeError, ValueError, OverflowError, ProtocolError)
JSON_FIELDS = ("row", "value")  # the user's data (a data row, a program's return), taken as JSON takes it


def pack(message: dict) -> bytes:
    """``{"kind": k, ...fields}`` as the one frame of protocol message ``program_<k>``: one of
    ``UNPACKABLE`` where it cannot be (the schema refuses it, msgpack cannot hold a value). A data
    row and a program's return are taken as JSON takes them (a key as text, a tuple as a list), as
    a row read from a file is, and a reward anywhere."""
    kind = message["kind"]
    fields = {name: json.loads(json.dumps(value)) if name in JSON_FIELDS else value
              for name, value in message.items() if name != "kind"}
    return bytes(encode(f"program_{kind}", fields)[0])


def unpack(data: bytes, kinds: tuple[str, ...]) -> dict:
    """The message in ``data`` as ``{"kind", ...fields}`` if it is one of ``kinds``, else ``ProtocolError``."""
    message = decode([data])
    kind = message.type.removeprefix("program_")
    if kind not in kinds or not message.type.startswith("program_"):
        raise ProtocolError(f"a {message.type} message where a {' or '.join(kinds)} message was expected")
    return {"kind": kind, **message.fields}


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
    calls = OverConnection(connection)
    client = (AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=deadline_s,
                          http_client=httpx.AsyncClient(transport=calls, timeout=deadline_s)) if asynchronous
              else OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=deadline_s))
    # a plain program that hangs keeps its thread past its deadline: a pool that grows with them
    threads = None if asynchronous else ThreadPoolExecutor(max_workers=1024, thread_name_prefix="agent-program")
    tasks: dict[str, asyncio.Task] = {}
    closed = loop.create_future()

    async def episode(key: str, row: dict) -> None:
        own = episode_client(client, key)
        try:
            run = function(own, row) if asynchronous else loop.run_in_executor(threads, function, own, row)
            _send(connection, {"kind": "return", "key": key, "value": await within(run, deadline_s)})
        except asyncio.CancelledError:
            pass  # its episode ended: the rollout expects nothing
        except PastDeadline as passed:  # the episode ends env_deadline, as in a thread
            _send(connection, {"kind": "raise", "key": key, "error": {"type": "PastDeadline", "deadline": True,
                                                                      "message": str(passed)}})
        except BaseException as error:
            _send(connection, {"kind": "raise", "key": key, "error": _described(error)})
        finally:
            tasks.pop(key, None)

    def readable() -> None:
        try:
            while connection.poll():
                message = unpack(connection.recv_bytes(), ("run", "cancel", "answer"))
                if message["kind"] == "answer":
                    calls.answered(message)
                elif message["kind"] == "run":
                    tasks[message["key"]] = loop.create_task(episode(message["key"], message["row"]))
                elif message["key"] in tasks:
                    tasks[message["key"]].cancel()
        except (EOFError, OSError, ProtocolError):  # the rollout closed it, or died, or is not the rollout
            if not closed.done():
                closed.set_result(None)

    loop.add_reader(connection.fileno(), readable)
    await closed
    for task in list(tasks.values()):
        task.cancel()
    if threads is not None:
        threads.shutdown(wait=False, cancel_futures=True)


class OverConnection(httpx.AsyncBaseTransport):
    """An async program's calls sent to the rollout over the process's connection and answered
    there by the endpoint (``ProgramProcesses.answer``): no HTTP server on the rollout's side,
    no connection pool on this one."""

    def __init__(self, connection) -> None:
        self.connection = connection
        self.waiting: dict[int, asyncio.Future] = {}  # by the call's id
        self.ids = iter(range(1 << 62))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        number = next(self.ids)
        self.waiting[number] = answer = asyncio.get_running_loop().create_future()
        key = episode_key(request.headers)
        try:
            _send(self.connection, {"kind": "call", "key": key, "id": number, "path": request.url.path,
                                    "body": (await request.aread()).decode()})
            message = await answer
        finally:
            self.waiting.pop(number, None)
        from environments.endpoint import http_response

        return http_response(request, message["status"], message["answer"], message["streamed"])

    def answered(self, message: dict) -> None:
        waiting = self.waiting.get(message["id"])
        if waiting is not None and not waiting.done():
            waiting.set_result(message)


def _send(connection, message: dict) -> None:
    """``message`` to the rollout; a return no message holds is sent as the program's error (a
    call's own error is its program's: ``pack`` raises it there)."""
    try:
        data = pack(message)
    except UNPACKABLE as error:
        if message["kind"] == "call":
            raise
        data = pack({"kind": "raise", "key": message["key"], "error": _described(TypeError(
            f"the agent program returned {type(message.get('value')).__name__}, which a message cannot hold "
            f"({error}): a reward is a number, None or a dict of numbers" if message["kind"] == "return" else
            f"the agent program's error could not be sent ({type(error).__name__}: {error})"))})
    try:
        connection.send_bytes(data)
    except (OSError, ValueError):  # the rollout is gone
        pass


def _raised(error: dict) -> BaseException:
    """A program's error as it came from its process: ``PastDeadline`` where it ran past its
    deadline there (so its episode ends env_deadline whichever deadline is seen first), else a
    ``ProgramError``."""
    if error.get("deadline") is True:
        return PastDeadline(str(error.get("message", "the agent program ran past rollout.agent_deadline_s")))
    return ProgramError(error)


def _described(error: BaseException) -> dict:
    """``error`` as it travels: its type, message, traceback and the file and line it was raised at."""
    frames = traceback.extract_tb(error.__traceback__)
    return {"type": type(error).__name__, "message": str(error),
            "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
            "where": [frames[-1].filename, frames[-1].lineno] if frames else []}


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
