"""Agent programs (``rollout.agent``): the user's own loop against the OpenAI API, trained as it is.

A program is ``run(client, row) -> reward``: ``client`` an ``openai.AsyncOpenAI`` (an ``openai.
OpenAI`` for a plain function) with its episode's key, pointed at the rollout's endpoint
(``environments.endpoint``: an async client reaches it in this process without HTTP, a plain one
through 127.0.0.1), ``row`` the prompt's data row; it returns the episode's reward, a number (or a dict
with ``reward``). Each episode's program runs in a thread of its own, within
``rollout.agent_deadline_s``; the threads, their event loops and clients serve one episode after
another (made anew for each, they cost the rollout's core more than the calls did).

To the rollout's loop an agent episode is an environment like any other (``rollout.episodes``):
its first call's messages are the episode's first observation, and each later call's messages
past what the program sent before and the reply it got (tool results, a user's turn) are the
observation after the policy's turn, rendered and appended token for token; the program's return
ends the episode with its reward on the last token. So the tokens trained are the ids the engine
generated and the ids of what came between, never a re-tokenized conversation, and the deadlines,
failure accounting and groups of episodes hold as they do for environments. A program that
rewrites its earlier messages (a compacted context) starts a new part of the episode from the
rewritten conversation (``environments.interface.Restart``: counted as ``episode_splits``); a
program that raises, hangs past ``rollout.env_step_deadline_s`` or returns what is not a reward
ends it as an environment would (``env_error``, ``env_deadline``).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import itertools
import json
import math
import os
import queue
import secrets
import signal
import subprocess
import threading
import time
import warnings
from concurrent.futures import Future
from typing import Any, Callable

from common import verifiers_data
from common.functions import load_function
from environments import agent_apis, verifiers_envs
from environments.endpoint import Call, Endpoint, HTTPError
from environments.interface import (BadStep, PastDeadline, Restart, Step, TokenIds, ToolError, Turn, as_step,
                                    check_observation)
from environments.program_runs import episode_client, within
from environments.tools import ToolCallParser


def agent_programs(config, tokenizer) -> "AgentPrograms | None":
    """``rollout.agent``'s (or ``rollout.agent_command``'s, or a verifiers environment's:
    ``environments.verifiers_envs``) programs and their endpoint, or None without one; its calls' tool
    calls read by vLLM's parser ``rollout.tool_parser`` for the policy's ``tokenizer``."""
    rollout = config.rollout
    env_id = verifiers_data.environment_id(rollout.environment)
    if not (rollout.agent or rollout.agent_command or env_id):
        return None
    parser = ToolCallParser(rollout.tool_parser, tokenizer, None, rollout.reasoning_parser)
    program = verifiers_envs.program(env_id, rollout.environment_args) if env_id else None
    return AgentPrograms(program or rollout.agent or rollout.agent_command, parser,
                         rollout.agent_deadline_s, rollout.env_step_deadline_s, config.sampling,
                         bool(config.models.reward or config.scorer.reward_functions or config.scorer.judges
                              or config.scorer.reward_url or config.models.teacher),
                         rollout.agent_processes, config.placement.cores.get("agent"))


class AgentPrograms:
    """The run's agent program, its endpoint and the episodes calling it (each by its key)."""

    def __init__(self, program: str | list[str] | Callable, parser, deadline_s: float, step_deadline_s: float,
                 sampling=None, others_score: bool = False, processes: int = 0, cores: list[int] | None = None
                 ) -> None:
        """``program``: "module:function" (or the function), or a command's arguments (``rollout.agent_command``);
        ``sampling``: the run's ``SamplingConfig``, which calls may not ask to change (None: unchecked);
        ``others_score``: a reward model or reward functions score the episodes too (a program may
        then return None); ``processes``: a function's programs run in this many processes of their
        own, on ``cores`` (``rollout.agent_processes``), else in threads of this one."""
        self.sampling, self.others_score = sampling, others_score
        self.command = program if isinstance(program, list) else None
        self.program = program if callable(program) else None if self.command else load_function(
            program, "rollout.agent", check=lambda function: inspect.signature(function))
        self.parser = parser  # environments.tools.ToolCallParser
        # an episode's program, start to return (its calls wait on a busy engine too); one wait for its next call
        self.deadline_s, self.step_deadline_s = deadline_s, step_deadline_s
        self.under_way: dict[str, AgentEnvironment] = {}
        # the keys of episodes that ended, the last ENDED_KEPT: a late call of one hears 404, not 401
        self.ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.lock = threading.Lock()
        self.asynchronous = inspect.iscoroutinefunction(self.program)
        # a call waits for its turn at most as long as its episode may run (whose end answers it), and a grace
        self.endpoint = Endpoint(self.lookup, answer_deadline_s=deadline_s + ANSWER_GRACE_S)
        self.idle: list[ProgramThread] = []  # program threads waiting for an episode
        self.busy: set[ProgramThread] = set()  # and those running one (its program may hang past its end)
        self.closed = False
        self.processes = None
        if processes and not self.command:
            from environments.agent_processes import ProgramProcesses

            self.processes = ProgramProcesses(processes, program, self.endpoint.base_url, deadline_s, cores,
                                              self._delivered, self.endpoint.take)

    def lookup(self, key: str) -> "AgentEnvironment | Ended | None":
        """The episode of ``key``; ``ENDED`` where it ended (its calls are refused with 404); None for
        a key the rollout did not give (401)."""
        with self.lock:
            return self.under_way.get(key) or (ENDED if key in self.ended else None)

    def make(self, row: dict) -> "AgentEnvironment":
        """An episode's environment (``Environments``' factory)."""
        environment = AgentEnvironment(self, row)
        with self.lock:
            self.under_way[environment.key] = environment
        return environment

    def forget(self, key: str) -> None:
        with self.lock:
            if self.under_way.pop(key, None) is not None:
                self.ended[key] = None
                if len(self.ended) > ENDED_KEPT:
                    self.ended.popitem(last=False)
        if self.processes is not None:
            self.processes.cancel(key)

    def start(self, environment: "AgentEnvironment") -> None:
        """``environment``'s program on its row, in a program process (``rollout.agent_processes``) or
        on a program thread of its own (``ProgramThread``): one that blocks (a tool called without
        await) holds up its own episode alone. Its return or error goes to the episode's events."""
        if self.processes is not None:
            return self.processes.start(environment.key, environment.row)
        with self.lock:
            held = sum(1 for runner in self.busy if runner.environment is not None and runner.environment.ended)
            if held < HELD_THREADS_LIMIT:
                runner = self.idle.pop() if self.idle else ProgramThread(self)
                runner.environment = environment
                self.busy.add(runner)
        if held >= HELD_THREADS_LIMIT:  # a plain function cannot be stopped: no more threads for programs that hang
            return environment.event("raise", RuntimeError(
                f"{held} agent program threads still run programs whose episodes ended (past rollout.agent_deadline_s: "
                "a plain function cannot be stopped, and each holds its thread): no thread for another; make the "
                "program async (it is cancelled at its deadline) or bound its own waits"))
        runner.jobs.put(environment)

    def _delivered(self, key: str, kind: str, value: Any) -> None:
        """A program process's answer for the episode of ``key``: its return or its error."""
        with self.lock:
            environment = self.under_way.get(key)
        if environment is not None:  # else it ended first
            environment.event(kind, value)

    def done(self, runner: "ProgramThread") -> None:
        """``runner``'s program returned: it takes the next episode (one whose program hangs past its
        deadline keeps its thread, and only that one)."""
        with self.lock:
            self.busy.discard(runner)
            runner.environment = None
            if not self.closed:
                self.idle.append(runner)
                return
        runner.jobs.put(None)

    def close(self) -> None:
        with self.lock:
            under_way, self.under_way = list(self.under_way.values()), {}
            idle, self.idle, self.closed = self.idle, [], True
        for environment in under_way:
            environment.close()
        for runner in idle:
            runner.jobs.put(None)
        if self.processes is not None:
            self.processes.close()
        self.endpoint.close()


ANSWER_GRACE_S = 30.0
HELD_THREADS_LIMIT = 64  # program threads held by programs running past their episode's end, at most
ENDED_KEPT = 10_000  # ended episodes' keys kept (32 bytes each) to tell a late call from a stranger's


class Ended:
    """What a key of an ended episode finds: its calls are refused with 404."""

    @staticmethod
    def offer(call: Call) -> HTTPError:
        return HTTPError(404, "this episode has ended")


ENDED = Ended()


class ProgramThread:
    """A thread that runs episodes' programs one after another, with what each would otherwise
    make anew: an event loop and a client (an ``AsyncOpenAI`` reaching the endpoint in this process
    through ``Endpoint.transport``, not HTTP; an ``OpenAI`` for a plain function, through 127.0.0.1). An
    episode's client is a copy of it with the episode's key."""

    def __init__(self, programs: AgentPrograms) -> None:
        self.programs = programs
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()  # episodes, then None
        self.environment: AgentEnvironment | None = None  # the one its program runs for
        threading.Thread(target=self.serve, name="agent-program", daemon=True).start()

    def serve(self) -> None:
        programs = self.programs
        loop = asyncio.new_event_loop() if programs.asynchronous else None
        client, unmade = None, None
        try:
            if not programs.command:
                client = _client(programs.endpoint, programs.deadline_s, programs.asynchronous)
        except Exception as error:  # each episode given to this thread fails with why, none waits on it
            unmade = RuntimeError(f"the agent program's OpenAI client could not be built ({type(error).__name__}: "
                                  f"{error})")
            unmade.__cause__ = error
        try:
            while (environment := self.jobs.get()) is not None:
                if unmade is not None:
                    environment.event("raise", unmade)
                else:
                    _deliver(environment, lambda: self.run(environment, client, loop))
                programs.done(self)
        finally:
            if client is not None and programs.asynchronous:
                loop.run_until_complete(client.close())
            elif client is not None:
                client.close()
            if loop is not None:
                _close_loop(loop)

    def run(self, environment: "AgentEnvironment", client, loop: asyncio.AbstractEventLoop | None) -> Any:
        """``environment``'s program to its return: the function with a copy of ``client`` of the
        episode's key, or the command."""
        programs = self.programs
        if programs.command:
            return _run_command(programs.command, programs.endpoint, environment, programs.deadline_s)
        own = episode_client(client, environment.key)
        if programs.asynchronous:
            return loop.run_until_complete(_whole(programs.program(own, environment.row), programs.deadline_s))
        return programs.program(own, environment.row)


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """A program thread's loop closed with nothing left pending: the tasks and async generators a
    streamed call leaves (the SDK's stream, its response's body) are closed first, else the
    interpreter's exit prints "Task was destroyed but it is pending"."""
    left = asyncio.all_tasks(loop)
    for task in left:
        task.cancel()
    if left:  # gather() of nothing asks for the thread's current loop, which a program thread has none of
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


def _run_command(command: list[str], endpoint: Endpoint, environment: "AgentEnvironment", deadline_s: float
                 ) -> Any:
    """An agent program in a process of its own (``rollout.agent_command``), as OpenAI's and
    Anthropic's clients configure themselves: ``OPENAI_BASE_URL``, ``ANTHROPIC_BASE_URL`` and
    ``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY`` (the episode's key) in its environment; the row, a
    JSON line, on its stdin; its reward on stdout's last line (a number, or a JSON object with
    ``reward``; earlier lines are its own). The episode's end kills it."""
    # an inherited ANTHROPIC_AUTH_TOKEN would be sent before the episode's key by clients that prefer it
    variables = {**{k: v for k, v in os.environ.items() if k != "ANTHROPIC_AUTH_TOKEN"},
                 "OPENAI_BASE_URL": endpoint.base_url, "OPENAI_API_KEY": environment.key,
                 "ANTHROPIC_BASE_URL": endpoint.root_url, "ANTHROPIC_API_KEY": environment.key}
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=variables, text=True, start_new_session=True)
    environment.process = process
    if environment.ended:  # ended while the process started: close() did not see it
        _kill(process)
    try:
        out, err = _communicate(process, json.dumps(environment.row) + "\n", deadline_s)
    except subprocess.TimeoutExpired:
        _kill(process)
        raise PastDeadline(f"the agent command {command[0]} ran past rollout.agent_deadline_s {deadline_s:g}") from None
    tail = "\n".join(err.strip().splitlines()[-20:])
    if process.returncode != 0:
        raise RuntimeError(f"the agent command {command[0]} exited with {process.returncode}; its stderr ends:\n{tail}")
    lines = out.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        said = (f"printed {lines[-1][:200]!r} last, not its reward (a number, or a JSON object with 'reward')"
                if lines else "printed nothing: its reward goes on stdout's last line")
        raise BadStep(f"the agent command {command[0]} {said}") from None


COMMAND_OUTPUT_KEPT = 1 << 20  # characters of an agent command's stdout and of its stderr kept, the last ones


def _communicate(process: subprocess.Popen, text: str, deadline_s: float) -> tuple[str, str]:
    """``Popen.communicate`` that keeps the last ``COMMAND_OUTPUT_KEPT`` characters of each stream
    alone: a command that logs without end on stdout holds no more of the rollout's memory (its
    reward is on its last line). ``TimeoutExpired`` past ``deadline_s``."""
    def keep(stream, kept: list[str]) -> None:
        for chunk in iter(lambda: stream.read(1 << 16), ""):
            kept.append(chunk)
            if sum(map(len, kept)) > 2 * COMMAND_OUTPUT_KEPT:
                kept[:] = ["".join(kept)[-COMMAND_OUTPUT_KEPT:]]

    def give() -> None:
        try:
            process.stdin.write(text)
            process.stdin.close()
        except OSError:  # it exited without reading its row: its exit code says why
            pass

    outputs: tuple[list[str], list[str]] = ([], [])
    threads = [threading.Thread(target=give, daemon=True),
               *(threading.Thread(target=keep, args=(stream, kept), daemon=True)
                 for stream, kept in zip((process.stdout, process.stderr), outputs))]
    for thread in threads:
        thread.start()
    process.wait(timeout=deadline_s)
    for thread in threads:  # at their streams' end; a stream held open by a child of its own: left to the OS
        thread.join(timeout=5.0)
    return tuple("".join(kept)[-COMMAND_OUTPUT_KEPT:] for kept in outputs)


def _kill(process: subprocess.Popen) -> None:
    """An agent command and every process it started (its session's group: a wrapper such as
    ``bash run.sh`` or ``uv run`` would otherwise leave the agent running, holding its pipes)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _client(endpoint: Endpoint, timeout_s: float, asynchronous: bool):
    """A client of the endpoint (its key set per episode); it never retries: a refused call is the
    program's to see. An async one reaches the endpoint in this process, without HTTP
    (``Endpoint.transport``); its own transport also skips the TLS set-up a default client costs."""
    import httpx
    from openai import AsyncOpenAI, OpenAI

    if not asynchronous:
        return OpenAI(base_url=endpoint.base_url, api_key="-", max_retries=0, timeout=timeout_s)
    http = httpx.AsyncClient(transport=endpoint.transport(), timeout=timeout_s)
    return AsyncOpenAI(base_url=endpoint.base_url, api_key="-", max_retries=0, timeout=timeout_s, http_client=http)


async def _whole(program, deadline_s: float) -> Any:
    """An async program's result, or PastDeadline past ``deadline_s`` (it is cancelled then, so
    that one awaiting forever frees its thread); the tasks it started and left running are
    cancelled with its end, so none runs on into the next episode of its thread."""
    try:
        return await within(program, deadline_s)
    finally:
        current = asyncio.current_task()
        left = [task for task in asyncio.all_tasks() if task is not current]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)


class AgentEnvironment:
    """One episode of the agent program, as the environment ``rollout.episodes`` drives."""

    def __init__(self, programs: AgentPrograms, row: dict) -> None:
        self.programs, self.row = programs, row
        self.key = secrets.token_hex(16)
        # the program's calls and its end, ("call", Call), ("return", value) or ("raise", error), taken
        # by the rollout's next wait for them (``expecting``: its future, and how it reads the event)
        self.events: collections.deque = collections.deque()
        self.expecting: tuple[Future, Callable[[str, Any], Any]] | None = None
        self.call: Call | None = None  # the call the policy's next turn answers
        self.sent: list[dict] = []  # the conversation as the program sent it, with the replies it got
        self.tools: list[dict] | None = None  # the program's tools, as its first call passed them
        # the conversation through each of its Responses API answers (previous_response_id)
        self.conversations: agent_apis.Conversations = {}
        self.completion: bool | None = None  # its calls are completions (not chat), from its first
        self.text, self.ids = "", []  # a completions episode so far, as the program knows it and as the engine does
        self.unsaid = ""  # the text of the stop token ending self.ids that the last answer's text omits
        self.ended = False
        self.unanswered = False  # a call of the program's waits for its turn: a second one is refused
        self.spent = False  # its last turn was cut at rollout.max_new_tokens: calls are refused, its return awaited
        self.deadline = math.inf  # when the program must have returned
        self.process: subprocess.Popen | None = None  # a command's (rollout.agent_command)
        self.lock = threading.Lock()

    def offer(self, call: Call) -> HTTPError | None:
        """From the endpoint: the program's next call, or why it is refused."""
        refused = refusal(call.request, self.programs.sampling)
        if refused is not None:
            return HTTPError(400, refused)
        call.sampling = self.programs.sampling
        with self.lock:
            spent = self.spent
        if spent:  # answered at once, with nothing: a program that reads no finish_reason still ends and returns
            tokenizer, nothing = self.programs.parser.tokenizer, Turn(0, [], [], "length")
            if call.completion:
                call.answer(_completion_answer(call.request, "", nothing, tokenizer))
                return None
            answer = _answer(call.request, "", [], nothing, tokenizer)
            agent_apis.remember(call, self.conversations, [*map(_plain, call.request.messages), _reply(answer)])
            call.answer(answer)
            return None
        with self.lock:
            if self.unanswered:  # two calls at once would be two branches of one token stream
                return HTTPError(409, "this episode has a call waiting for its answer: an episode is one "
                                      "conversation, its calls made one after another (two at once, as "
                                      "asyncio.gather would make them, are refused); run concurrent "
                                      "conversations as episodes of their own (rollout.samples_per_prompt)")
            self.unanswered = True
        # with close(): a call is either taken before the episode ends or refused
        return HTTPError(404, "this episode has ended") if not self.event("call", call) else None

    def event(self, kind: str, value: Any) -> bool:
        """The program's call or its end (from its thread, the endpoint's or a program process's
        answer): read at once by the rollout's wait for it, in this thread, or kept for the next.
        False once the episode has ended."""
        with self.lock:
            if self.ended:
                return False
            if self.expecting is None:
                self.events.append((kind, value))
                return True
            (future, read), self.expecting = self.expecting, None
        self._take_event(future, read, kind, value)
        return True

    def _expect(self, read: Callable[[str, Any], Any]) -> Future:
        """A future of what ``read`` makes of the program's next event: the rollout's loop waits on it
        as on an environment's call in a thread, with no thread between (a hand-over less a call)."""
        future: Future = Future()
        with self.lock:
            if not self.events:
                self.expecting = (future, read)
                return future
            kind, value = self.events.popleft()
        self._take_event(future, read, kind, value)
        return future

    def _take_event(self, future: Future, read: Callable[[str, Any], Any], kind: str, value: Any) -> None:
        _settle(future, read, kind, value)
        with self.lock:
            ended, call = self.ended, self.call
        if ended and call is not None:  # it ended as this call was taken: close() may have looked before
            call.answer(HTTPError(404, "this episode has ended"))

    @property
    def turn_max_tokens(self) -> int | None:
        """What the call the policy answers next asks for at most (``max_completion_tokens``)."""
        return _max_tokens(self.call.request) if self.call is not None else None

    def begin_reset(self) -> Future:
        """Starts the program: a future of its first call's messages, the episode's first observation."""
        self.deadline = time.monotonic() + self.programs.deadline_s
        future = self._expect(self._first)
        self.programs.start(self)
        return future

    def begin_step(self, response: str, messages: list[dict], turn: Turn | None = None) -> Future:
        """The policy's turn answers the program's call now: a future of the ``Step``, its next call
        (the observation: what it added to the conversation) or its return (the reward, and the
        episode's end). ``turn``: the engine's tokens and logprobs of the turn (None: ``response``
        tokenized, as a test gives it), for a call that asks for them."""
        call = self.call
        with self.lock:  # before the answer: the program may call again as soon as it has it
            self.unanswered = False
        try:
            tool_calls, errors = self._answer(call, response, turn)
        except BaseException as error:  # the call is answered whatever happens: its program must not wait on
            call.answer(HTTPError(500, f"the rollout could not answer this call ({type(error).__name__}: {error})"))
            raise
        finally:
            self.call = None
        return self._expect(functools.partial(self._after, len(tool_calls) + len(errors), errors))

    def begin_last(self, response: str, messages: list[dict], turn: Turn | None = None) -> Future:
        """``begin_step`` for a turn the run cut at ``rollout.max_new_tokens``: the call is answered
        with it (finish_reason "length"), and the program's return is the episode's reward. The
        episode has no more turns: a later call is answered at once with no tokens, finish_reason
        "length" again, and nothing of it is trained."""
        with self.lock:
            self.spent = True
        return self.begin_step(response, messages, turn)

    def _first(self, kind: str, value: Any) -> list[dict] | TokenIds | Restart:
        if kind == "return":
            raise BadStep("the agent program returned before it called the model")
        self.tools = _tools_of(value.request)
        return check_observation(self._take(value))

    def _after(self, tool_calls: int, errors: list[ToolError], kind: str, value: Any) -> Step:
        if kind == "call":  # its messages checked as any environment's observation is
            return as_step(Step(self._take(value), tool_calls=tool_calls, tool_errors=errors))
        reward, metrics = _reward(value, self.programs.others_score)
        return Step(None, reward, done=True, tool_calls=tool_calls, tool_errors=errors, metrics=metrics)

    def _answer(self, call: Call, response: str, turn: Turn | None) -> tuple[list, list[ToolError]]:
        """``call`` answered with the policy's turn; the turn's tool calls and its malformed one."""
        tokenizer = self.programs.parser.tokenizer
        if call.completion:
            call.answer(_completion_answer(call.request, response, turn, tokenizer))
            ids = turn.token_ids if turn is not None else tokenizer(response, add_special_tokens=False)["input_ids"]
            self.text, self.ids = self.text + response, self.ids + list(ids)
            self.unsaid = _unsaid(ids, response, tokenizer)
            return [], []
        parser = self.programs.parser
        text = parser.text_of(turn.token_ids) if turn is not None else response
        reasoning, text = parser.reasoning.split(text) if parser.reasoning is not None else (None, text)
        content, tool_calls, unread = parser.openai_calls(text, call.request)
        unfit = agent_apis.unfit(call.api, tool_calls)
        if unfit is not None:  # calls the call's API cannot carry: the turn's text, as a malformed call's
            content, tool_calls, unread = text, [], unfit
        answer = _answer(call.request, content, tool_calls, turn, tokenizer, reasoning)
        self.sent.append(_reply(answer))
        agent_apis.remember(call, self.conversations, self.sent)
        call.answer(answer if unread is None else _marked(answer, unread))
        return tool_calls, [] if unread is None else [ToolError("malformed", None, {}, unread)]

    def close(self) -> None:
        """The episode ended: a call waiting for its turn is refused, and later ones (at once: nothing
        here waits)."""
        with self.lock:
            self.ended = True
        self.programs.forget(self.key)
        if self.process is not None and self.process.poll() is None:
            _kill(self.process)
        if self.call is not None:
            self.call.answer(HTTPError(404, "this episode has ended"))
        with self.lock:
            events, self.events = self.events, collections.deque()
            expecting, self.expecting = self.expecting, None
        for kind, value in events:  # calls taken before the end, that no turn will answer
            if kind == "call":
                value.answer(HTTPError(404, "this episode has ended"))
        if expecting is not None:
            expecting[0].set_exception(BadStep("the episode ended"))

    def _take(self, call: Call) -> list[dict] | TokenIds | Restart:
        """What ``call`` adds to the episode: what it sends past what the program sent before and
        the replies it got, message for message (chat) or token for token (completions: text, or
        ids); a call that does not extend them (the program rewrote its context) starts the
        episode's sample over from its whole conversation (``Restart``)."""
        if self.completion is None:
            self.completion = call.completion
        if call.completion != self.completion:
            call.answer(HTTPError(400, "an episode's calls are all chat completions or all completions"))
            raise BadStep("the agent program mixed chat-completions and completions calls in one episode")
        if call.completion:
            return self._take_prompt(call)
        messages = [_plain(message) for message in call.request.messages]
        if not _same(messages[:len(self.sent)], self.sent):  # a rewritten context: the sample starts over
            self.sent, self.call, self.tools = messages, call, _tools_of(call.request)
            return Restart(messages)
        added, self.sent, self.call = messages[len(self.sent):], messages, call
        if not added:
            raise BadStep("the agent program called again with no new message")
        return added

    def _take_prompt(self, call: Call) -> TokenIds | Restart:
        """A completions call's prompt past the episode so far: the ids it gives past the episode's
        ids, or the text past the episode's text, tokenized alone (so the ids the engine generated
        are never tokenized again). The first prompt, and one that does not extend the episode (a
        rewritten context: the sample starts over), is tokenized whole, as vLLM's server does."""
        prompt, tokenizer = call.request.prompt, self.programs.parser.tokenizer
        self.call = call
        unsaid, self.unsaid = self.unsaid, ""
        if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
            if not prompt or max(prompt) >= len(tokenizer):
                call.answer(HTTPError(400, f"prompt: {'no ids' if not prompt else f'id {max(prompt)}'}: the "
                                           f"policy's vocabulary has {len(tokenizer)} ids"))
                raise BadStep("the agent program's completions prompt is empty or has ids past the vocabulary")
            # the stop token the engine sampled, left out where the program extends the ids before it
            left_out = int(bool(unsaid) and prompt[:len(self.ids)] != self.ids
                           and prompt[:len(self.ids) - 1] == self.ids[:-1])
            kept = self.ids[:len(self.ids) - left_out]
            if self.ids and prompt[:len(kept)] != kept:
                self.ids, self.text = list(prompt), tokenizer.decode(prompt)
                return Restart(TokenIds(prompt))
            added = prompt[len(kept):]
            self.text += tokenizer.decode(added)
        elif isinstance(prompt, str):
            if not prompt:
                call.answer(HTTPError(400, "prompt: empty"))
                raise BadStep("the agent program's completions prompt is empty")
            if self.ids and not prompt.startswith(self.text):
                self.text, self.ids = prompt, tokenizer(prompt)["input_ids"]
                return Restart(TokenIds(self.ids))
            # a completion's text omits the stop token the engine sampled (as vLLM's server does): a
            # program that writes it back (ChatML's "<|im_end|>" after the turn) writes what the
            # stream holds already; one that does not leaves it out of its transcript, and so of the stream
            rest = prompt[len(self.text):]
            left_out = int(bool(unsaid) and not rest.startswith(unsaid))
            rest = rest if left_out else rest[len(unsaid):]
            kept = self.ids[:len(self.ids) - left_out]
            added = tokenizer(rest, add_special_tokens=not kept)["input_ids"]
            self.text = prompt
        else:
            call.answer(HTTPError(400, "prompt: an episode's call gives one prompt, as text or token ids"))
            raise BadStep("the agent program's completions call gave several prompts")
        self.ids = kept + list(added)
        return TokenIds(added, unsaid=left_out)


def _unsaid(ids: list[int], text: str, tokenizer) -> str:
    """The text of the stop token ending a turn's ``ids`` that its ``text`` (decoded without special
    tokens, as a completion's answer gives it) omits; "" where there is none, or where the turn is
    that token alone (its turn keeps it: a turn has at least one token)."""
    if len(ids) < 2 or ids[-1] not in tokenizer.all_special_ids:
        return ""
    piece = tokenizer.decode([ids[-1]])
    return "" if text.endswith(piece) else piece


def _tools_of(request) -> list[dict] | None:
    """A call's tools as the chat template renders them (a completions call has none: its prompt is
    the policy's text)."""
    tools = getattr(request, "tools", None)
    return tools and [tool.model_dump(exclude_none=True) for tool in tools]


def _deliver(environment: AgentEnvironment, run) -> None:
    """``run()``'s return or error to ``environment``'s events: a program's own failure ends its episode
    (env_error), it never reaches the rollout's loop."""
    try:
        value = run()
    except BaseException as error:
        environment.event("raise", error)
    else:
        environment.event("return", value)


def _settle(future: Future, read: Callable[[str, Any], Any], kind: str, value: Any) -> None:
    """``future`` given what ``read`` makes of the program's event (``kind``, ``value``): the
    program's error, or ``read``'s, is the future's."""
    try:
        if kind == "raise":
            raise value
        future.set_result(read(kind, value))
    except BaseException as error:
        future.set_exception(error)


# what would make a call's turn come from another distribution than the run's, or be cut otherwise
DISTRIBUTION_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias",
                       "min_tokens", "ignore_eos", "response_format", "structured_outputs", "bad_words",
                       "allowed_token_ids")


@functools.cache
def _distribution_defaults(request_type: type) -> dict[str, Any]:
    """The defaults of a request type's ``DISTRIBUTION_FIELDS``: read once, as pydantic reads each by
    parsing its factory's signature (a sixth of a call's time when read per call)."""
    fields = request_type.model_fields
    return {key: fields[key].get_default(call_default_factory=True) for key in DISTRIBUTION_FIELDS if key in fields}


def _max_tokens(request) -> int | None:
    """What a call asks for at most: ``max_completion_tokens``, or the older ``max_tokens`` (whose
    reading vLLM's chat request warns of)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        asked = getattr(request, "max_completion_tokens", None)
        return asked if asked is not None else request.max_tokens


def refusal(request, sampling) -> str | None:
    """Why the endpoint refuses a call's ``request`` (vLLM's ``ChatCompletionRequest`` or
    ``CompletionRequest``), or None. An episode's call is a turn of one token stream, sampled from
    the run's distribution (``sampling``: the run's ``SamplingConfig``, whose logprobs the learner
    recomputes), so a call may not ask for another distribution, several completions or tools it
    must call."""
    asked = _max_tokens(request)
    if asked is not None and asked < 1:
        return f"max_tokens {asked}: a turn has at least one token"
    defaults = _distribution_defaults(type(request))
    changed = [key for key, default in defaults.items() if getattr(request, key) != default]
    if changed:
        return (f"{', '.join(changed)}: the run samples each turn as sampling says (the learner's logprobs are "
                "of that distribution), with no penalties, constraints or formats of a call's own")
    if request.n != 1:
        return f"n is {request.n}: an episode's call asks for one completion (rollout.samples_per_prompt gives several)"
    if getattr(request, "top_logprobs", 0) or (isinstance(request.logprobs, int) and not isinstance(
            request.logprobs, bool) and request.logprobs > 0):
        return ("top_logprobs: the engine records the logprob of the token it sampled alone (logprobs: true in chat, "
                "logprobs: 0 in completions)")
    if getattr(request, "echo", False) or getattr(request, "suffix", None):
        return "echo, suffix: a completion is the policy's turn after the prompt alone"
    if getattr(request, "tool_choice", None) not in (None, "auto", "none"):
        return (f"tool_choice {request.tool_choice!r}: the policy calls a tool or not as it samples; only auto "
                "(and none) are served")
    if request.stop or request.stop_token_ids:
        return "stop: the run's turns end where the policy ends them (its end-of-turn token or rollout.max_new_tokens)"
    if sampling is not None:
        for key in ("temperature", "top_p", "top_k"):
            asked, run = getattr(request, key), getattr(sampling, key)
            if asked is not None and asked != run and not (key == "top_k" and asked in (0, -1) and run in (0, -1)):
                return (f"{key} {asked}: this run samples at sampling.{key} {run} (the learner's logprobs are of "
                        "that distribution)")
    return None


def _answer(request, content: str | None, tool_calls: list, turn: Turn | None, tokenizer,
            reasoning: str | None = None):
    """vLLM's ``ChatCompletionResponse`` to ``request`` of a turn read as ``reasoning``, ``content``
    and ``tool_calls``, with the token counts, and the engine's logprobs (``logprobs: true``) and token
    ids (``return_token_ids``) where the call asks for them."""
    from vllm.entrypoints.openai.chat_completion.protocol import (ChatCompletionLogProbs,
                                                                  ChatCompletionLogProbsContent,
                                                                  ChatCompletionResponse,
                                                                  ChatCompletionResponseChoice, ChatMessage)

    usage, pieces, token_ids = _turn_figures(request, turn, tokenizer, wants_logprobs=bool(request.logprobs))
    logprobs = None if pieces is None else ChatCompletionLogProbs(content=[
        ChatCompletionLogProbsContent(token=piece, logprob=logprob, bytes=list(piece.encode()), top_logprobs=[])
        for piece, logprob in zip(pieces, turn.logprobs)])
    choice = ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content=content,
                                                                       tool_calls=tool_calls, reasoning=reasoning),
                                          logprobs=logprobs, token_ids=token_ids,
                                          finish_reason="tool_calls" if tool_calls else _finish(turn))
    return ChatCompletionResponse(model=request.model or "policy", usage=usage, choices=[choice])


def _completion_answer(request, text: str, turn: Turn | None, tokenizer):
    """vLLM's ``CompletionResponse`` to a completions ``request``: the turn's text, with the token
    counts and, where asked (``logprobs: 0``, ``return_token_ids``), the engine's logprobs and ids."""
    from vllm.entrypoints.openai.completion.protocol import (CompletionLogProbs, CompletionResponse,
                                                             CompletionResponseChoice)

    usage, pieces, token_ids = _turn_figures(request, turn, tokenizer, wants_logprobs=request.logprobs is not None)
    logprobs = None if pieces is None else CompletionLogProbs(
        text_offset=list(itertools.accumulate(map(len, pieces), initial=0))[:-1],
        token_logprobs=list(turn.logprobs), tokens=pieces, top_logprobs=[None] * len(pieces))
    choice = CompletionResponseChoice(index=0, text=text, logprobs=logprobs, token_ids=token_ids,
                                      finish_reason=_finish(turn))
    return CompletionResponse(model=request.model or "policy", usage=usage, choices=[choice])


def _turn_figures(request, turn: Turn | None, tokenizer, wants_logprobs: bool):
    """What either route's answer says of the engine's turn: the token counts, each token's text
    where the call asks for logprobs (else None), and the ids where it asks for them
    (``return_token_ids``; else None)."""
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    if turn is None:
        return UsageInfo(), None, None
    usage = UsageInfo(prompt_tokens=turn.prompt_length, completion_tokens=len(turn.token_ids),
                      total_tokens=turn.prompt_length + len(turn.token_ids))
    pieces = [tokenizer.decode([token]) for token in turn.token_ids] if wants_logprobs else None
    return usage, pieces, list(turn.token_ids) if getattr(request, "return_token_ids", False) else None


def _finish(turn: Turn | None) -> str:
    """A turn's finish reason as OpenAI's API says it: "length" for a turn cut at the call's
    ``max_tokens``, else "stop"."""
    return "length" if turn is not None and turn.finish_reason == "length" else "stop"


def _marked(answer, unread: str) -> dict:
    """``answer`` as JSON, its message carrying ``tool_call_error``: a call the policy began and the
    parser could not read comes back as the turn's text, and the program sees why (OpenAI's API
    has no field for it; its client keeps fields it does not know)."""
    marked = answer.model_dump(mode="json", exclude_none=True)
    marked["choices"][0]["message"]["tool_call_error"] = unread
    return marked


def _plain(message: Any) -> dict:
    """A chat message as the template renders it and as it compares: role, content as text (parts
    that show images kept as parts, for a policy that sees: ``image_url`` with a ``data:`` URL, the
    Responses API's ``input_image`` made one, or ``{"type": "image", ...}``), and the tool calls or
    the call answered where there are some."""
    message = dict(message)
    content = message.get("content")
    parts = [_image_url(dict(part)) for part in content if isinstance(part, dict)] if isinstance(content, list) else []
    if any(part.get("type") in ("image", "image_url") for part in parts):
        content = [part if part.get("type") not in ("text", "input_text") else
                   {"type": "text", "text": part.get("text") or ""} for part in parts]
    elif isinstance(content, list):  # content parts: their text
        content = "".join(part.get("text", "") for part in parts)
    plain = {"role": message["role"], "content": content or ""}
    if message.get("tool_calls"):
        plain["tool_calls"] = [{"id": call["id"], "type": "function",
                                "function": {"name": call["function"]["name"],
                                             "arguments": call["function"]["arguments"]}}
                               for call in (dict(c) for c in message["tool_calls"])]
    for key in ("tool_call_id", "name"):
        if message.get(key):
            plain[key] = message[key]
    return plain


def _reply(answer) -> dict:
    """The message of ``answer`` (a ``ChatCompletionResponse``) as the episode keeps it (``_plain``)."""
    return _plain(answer.choices[0].message.model_dump(mode="json", exclude_none=True))


def _image_url(part: dict) -> dict:
    """A Responses API ``input_image`` part (its URL in ``image_url``) as chat's ``image_url`` part;
    any other part as it is."""
    if part.get("type") != "input_image":
        return part
    return {"type": "image_url", "image_url": {"url": part.get("image_url") or ""}}


def _same(sent: list[dict], before: list[dict]) -> bool:
    """Whether a call's messages ``sent`` (``_plain``'s) repeat those ``before``, a tool call's
    arguments compared as the JSON they are: an Anthropic call's ``tool_use`` input comes back as a
    dict, written again by vLLM's converter, a LangChain program's as LangChain writes it."""
    return [_compared(message) for message in sent] == [_compared(message) for message in before]


def _compared(message: dict) -> dict:
    """``message`` with each tool call's arguments read as JSON (left as text where they are not)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except (TypeError, ValueError):
            arguments = call["function"]["arguments"]
        calls.append({**call, "function": {**call["function"], "arguments": arguments}})
    return {**message, "tool_calls": calls}


def _reward(value: Any, others_score: bool) -> tuple[float, dict[str, float]]:
    """The program's return as the episode's reward and its own figures: a number, a dict with
    ``reward`` and any other numbers (per-episode metrics, logged as ``agent_<name>``), or None
    where the reward model or reward functions score the conversation instead (``others_score``)."""
    metrics = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise BadStep(f"the agent program returned a dict without 'reward' (keys {sorted(value)[:10]})")
        value, metrics = value["reward"], {k: v for k, v in value.items() if k != "reward"}
        for name, figure in metrics.items():
            if isinstance(figure, bool) or not isinstance(figure, (int, float)) or not math.isfinite(figure):
                raise BadStep(f"the agent program returned {name!r}: {json.dumps(figure, default=repr)[:100]}, not "
                              "a finite number (a dict's keys beside 'reward' are the episode's figures)")
    if value is None and others_score:
        return 0.0, metrics
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadStep(f"the agent program returned {json.dumps(value, default=repr)[:200]}, not a finite number"
                      + ("" if others_score else " (None is for runs where models.reward, scorer.reward_functions, "
                                                 "judges, reward_url or a teacher score the conversation)"))
    return float(value), {name: float(figure) for name, figure in metrics.items()}
