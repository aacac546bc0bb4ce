"""Native environments: a user's, the run's tools and an OpenEnv server's sessions, each an
``environments.interface.Environment`` (``NativeEnvironment``), and ``Environments``, which makes
the run's kind of environment for each episode (an agent program's too: ``environments.agents``).

``rollout.environment: my_env:make`` names a factory called with the prompt's data row; it returns
an object with

- ``reset()`` (optional): the episode's first messages (a list of ``{"role", "content"}``) or
  text, in place of the row's prompt; None keeps the row's prompt;
- ``step(response, messages)``: the policy's last turn as text and the conversation so far; it
  returns ``Step(observation, reward, done)`` (or the tuple, or a dict of those keys). The
  observation is messages or text (None: nothing to say), the reward is that turn's, and
  ``done`` ends the episode. A message's content may be a list of text and image parts
  (``{"type": "image", "image": <PNG bytes | PIL image | path>}``), which a policy that sees
  images is shown.

Tools (``rollout.tools``) are an environment of their own: a turn with tool calls is answered with
the tools' results; a turn without one goes to the configured environment, or ends the episode
when there is none. Both are called in threads of their own (``environments.threads``), never on
the engine's loop.
"""

from __future__ import annotations

import functools
import math
import threading
from concurrent.futures import Future
from typing import Any, Callable

from common import verifiers_data
from common.config import ConfigError, TetherConfig
from common.functions import load_function
from common.prompts import chat_of, text_chat
from environments import openenv, verifiers_envs
from environments.interface import BadStep, Observation, Step, ToolError, Turn, as_step, check_observation
from environments.threads import in_thread
from environments.tools import Tool, ToolCallParser, call_tool


class NativeEnvironment:
    """An environment that answers as it is called (a user's ``reset`` and ``step``, the tools', an
    OpenEnv session's) as an ``Environment``: each call in a thread of its own, the environment
    itself built in the first (``build``: a user's factory may take a while). ``gives_turns``: its
    ``step`` takes the engine's ``Turn`` too (the tools' and a server's: calls are read in its
    tokens); a user's takes the text and the conversation."""

    tools = None  # what its prompts render is the run's (a server's tools are the run's: Environments.tool_schemas)
    deadline = math.inf
    turn_max_tokens = None

    def __init__(self, build: Callable[[], Any], gives_turns: bool) -> None:
        self.build, self.gives_turns = build, gives_turns
        self.inner: Any = None
        self.lock = threading.Lock()
        self.resetting = False  # its reset (the environment built, then reset) is under way
        self.closed = False
        self.closing: Future | None = None  # its close: under way, or waiting for the reset under way to end

    def begin_reset(self) -> Future:
        with self.lock:
            self.resetting = True
        return in_thread(self._reset)

    def begin_step(self, response: str, messages: list[dict], turn: Turn | None = None) -> Future:
        return in_thread(self._step, response, messages, turn)

    def begin_last(self, response: str, messages: list[dict], turn: Turn | None = None) -> None:
        """Nothing answers a cut turn: the episode ends with it."""
        return None

    def close(self) -> Future | None:
        """Its ``close``, if it has one (an OpenEnv session's), once, in a thread; while its reset is
        under way, as that reset ends (a session opened after a close would outlive the episode)."""
        with self.lock:
            if self.closed:
                return self.closing
            self.closed = True
            if self.resetting:  # resolved by _reset_over
                self.closing = Future()
                return self.closing
            inner = self.inner
        close = getattr(inner, "close", None)
        self.closing = in_thread(close) if close is not None else None
        return self.closing

    def _reset(self) -> Observation:
        failed = True
        try:
            inner = self.build()
            with self.lock:
                self.inner, closed = inner, self.closed
            if closed:  # the episode ended while its environment was built
                return None
            reset = getattr(inner, "reset", None)
            first = check_observation(reset()) if reset is not None else None
            failed = False
            return first
        finally:
            self._reset_over(failed)

    def _reset_over(self, failed: bool) -> None:
        """The reset ended. What it built is closed now where it failed (its episode ends before it
        began: nothing else would close it) or where the episode ended meanwhile (a close waits)."""
        with self.lock:
            self.resetting, closing, inner = False, self.closing, self.inner
            close_now = closing is not None or (failed and not self.closed)
            self.closed = self.closed or failed
        try:
            close = getattr(inner, "close", None) if close_now else None
            if close is not None:
                close()
        except Exception:  # the episode's failure is its reset's (or its end's), said already
            pass
        finally:
            if closing is not None:
                closing.set_result(None)

    def _step(self, response: str, messages: list[dict], turn: Turn | None) -> Step:
        if self.gives_turns:
            return as_step(self.inner.step(response, messages, turn))
        return as_step(self.inner.step(response, messages))


class ToolEnvironment:
    """Answers a turn's tool calls with the tools' results (one tool message each); a turn without
    a call is the episode's answer: it goes to ``inner``'s step, or ends the episode. The calls are
    read in the turn's tokens (``ToolCallParser.text_of``), special tokens kept."""

    def __init__(self, tools: dict[str, Tool], inner: Any | None, parser: "ToolCallParser",
                 shows_images: bool = False) -> None:
        self.tools, self.inner, self.parser = tools, inner, parser
        self.shows_images = shows_images  # a policy that sees: a tool's images are shown to it

    def reset(self) -> Observation:
        reset = getattr(self.inner, "reset", None)
        return reset() if reset is not None else None

    def step(self, response: str, messages: list[dict], turn: "Turn | None" = None) -> Step:
        calls = self.parser.parse(self.parser.text_of(turn.token_ids) if turn is not None else response)
        if not calls:
            return as_step(self.inner.step(response, messages)) if self.inner is not None else Step(done=True)
        observation, errors = [], []
        for call in calls:
            content, error = call_tool(self.tools, call, self.shows_images)
            observation.append({"role": "tool", "name": call.name or "", "content": content})
            if error is not None:
                errors.append(error)
        return Step(observation, tool_calls=len(calls), tool_errors=errors)


class OpenEnvEnvironment:
    """An episode against an OpenEnv server (``rollout.environment: openenv:<url>``, environments/openenv.py):
    a turn's tool calls are steps of ``call_tool`` and their results tool messages; a turn without
    one is a step of the text action (its observation the user's next message), or, on a server of
    tools alone, the episode's end. A data row's ``reset`` object goes with the reset."""

    def __init__(self, server: "openenv.OpenEnv", row: dict) -> None:
        self.server, self.row = server, row
        self.tools = server.tools  # the episode's, rendered by the chat template
        self.session: openenv.Session | None = None

    def reset(self) -> str | list[dict]:
        """The server's first observation; where it says nothing (a server of tools alone), the
        row's prompt, rendered with the server's tools."""
        self.session = openenv.Session(self.server)
        try:
            first = self.session.reset(dict(self.row.get("reset") or {}))
        except BaseException:  # the server's session would outlive the episode
            self.close()
            raise
        return first or text_chat(chat_of(self.row, None) or [{"role": "user", "content": self.row.get("prompt", "")}])

    def step(self, response: str, messages: list[dict], turn: "Turn | None" = None) -> Step:
        parser = self.server.parser
        calls = parser.parse(parser.text_of(turn.token_ids) if turn is not None else response) if parser else []
        if not calls:
            if self.server.action is None:
                return Step(done=True)
            observation, reward, done = self.session.step(self.server.action(response))
            return Step(openenv.observation_text(observation) or None, reward, done)
        results, errors, reward, done = [], [], 0.0, False
        for call in calls:
            if call.name is None:  # begun and unreadable: the policy reads why
                content, error = call_tool({}, call)
            else:
                observation, turn_reward, turn_done = self.session.step(
                    {"type": "call_tool", "tool_name": call.name, "arguments": call.arguments})
                content, detail = openenv.tool_result(observation)
                error = None if detail is None else ToolError("raised", call.name, call.arguments, detail)
                reward, done = reward + turn_reward, done or turn_done
            results.append({"role": "tool", "name": call.name or "", "content": content})
            errors += [error] if error is not None else []
            if done:  # the episode is over: the turn's later calls are not the server's to answer
                break
        return Step(results, reward, done, tool_calls=len(calls), tool_errors=errors)

    def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close()


class Environments:
    """Makes one environment per episode, as the config says: the factory's, wrapped with the tools."""

    def __init__(self, factory: Callable[[dict], Any] | None, tools: dict[str, Tool],
                 server: "openenv.OpenEnv | None" = None, answering: Callable[[dict], Any] | None = None) -> None:
        """``server``: the OpenEnv server the factory's episodes play against, whose tools are theirs;
        ``answering``: what makes each episode's ``Environment`` itself from its row, in place of a
        native one (an agent program's, ``AgentPrograms.make``)."""
        self.factory, self.tools, self.server, self.answering = factory, tools, server, answering
        self.parser: ToolCallParser | None = None  # read_calls_with's, once the tokenizer is there
        self.shows_images = False  # showing_images's

    def showing_images(self, images: list[list[bytes]]) -> "Environments":
        """For a policy that sees, whose prompts show ``images``: tools' images are shown to it. An
        OpenEnv server's episodes with prompts that show images are refused: a server of tools alone
        starts from the row's text, which would drop them unseen."""
        if self.server is not None and any(images):
            raise ConfigError("rollout.environment: an OpenEnv server's episodes read the prompt's text alone; "
                              "data.prompts shows images, which they would drop (issue 36)")
        self.shows_images = True
        return self

    @staticmethod
    def load(environment: str | None, tools: dict[str, Tool], agent=None,
             step_deadline_s: float = 30.0) -> "Environments | None":
        """None where the config names neither: single responses, no episodes. ``agent``: a
        ``environments.agents.AgentPrograms``, whose episodes are its program's calls; ``environment``
        ``openenv:<url>``: an OpenEnv server's episodes, each message's answer awaited at most
        ``step_deadline_s`` (``rollout.env_step_deadline_s``: past it the rollout ends the episode)."""
        if agent is not None:
            return Environments(None, {}, answering=agent.make)
        if environment is None and not tools:
            return None
        if verifiers_data.environment_id(environment) is not None:
            raise ConfigError("rollout.environment: a verifiers environment's episodes are an agent program's "
                              "(environments.agents.agent_programs); give Environments.load its programs")
        if environment and environment.startswith(openenv.PREFIX):
            if tools:
                raise ConfigError("rollout.tools: an OpenEnv server's tools are its own (MCP); leave rollout.tools "
                                  "unset with rollout.environment openenv:<url>")
            server = openenv.OpenEnv(environment.removeprefix(openenv.PREFIX), deadline_s=step_deadline_s + 1.0)
            return Environments(lambda row: OpenEnvEnvironment(server, row), {}, server)
        factory = load_function(environment, "rollout.environment") if environment else None
        return Environments(factory, tools)

    def read_calls_with(self, parser_name: str, tokenizer, reasoning: str | None = None) -> "Environments":
        """Tool calls read by vLLM's parser ``parser_name`` (``rollout.tool_parser``) for the policy's
        ``tokenizer``, past the reasoning that vLLM's parser ``reasoning`` (``rollout.reasoning_parser``)
        sets apart; an unknown name, or one whose special tokens the tokenizer lacks, is a
        ConfigError naming the key. Without tools nothing is read."""
        if self.tools:
            self.parser = ToolCallParser(parser_name, tokenizer, self.tool_schemas, reasoning)
        if self.server is not None and self.server.tools:
            self.server.parser = ToolCallParser(parser_name, tokenizer, self.server.tools, reasoning)
        return self

    def make(self, row: dict):
        """The episode's ``Environment`` for its data ``row`` (a native one is made in its reset's
        thread: a factory may take a while)."""
        if self.answering is not None:
            return self.answering(row)
        if self.tools and self.parser is None:
            raise RuntimeError("Environments.read_calls_with was not called: tool calls cannot be read")
        return NativeEnvironment(functools.partial(self._inner_for, row),
                                 gives_turns=bool(self.tools) or self.server is not None)

    def _inner_for(self, row: dict) -> Any:
        """What answers ``row``'s episode: the factory's environment, wrapped with the tools if any."""
        inner = self.factory(row) if self.factory is not None else None
        if inner is not None and not self.tools:
            return inner
        if inner is None and not self.tools:
            raise BadStep("rollout.environment's factory returned None for this row: it returns an environment")
        return ToolEnvironment(self.tools, inner, self.parser, self.shows_images)

    @property
    def tool_schemas(self) -> list[dict] | None:
        """What the chat template renders into each episode's prompt: rollout.tools' schemas, or an
        OpenEnv server's MCP tools (every episode's own, ``OpenEnvEnvironment.tools``)."""
        if self.server is not None:
            return self.server.tools
        return [tool.schema for tool in self.tools.values()] or None


def prompt_tools(config: TetherConfig, environments: Environments | None) -> list[dict] | None:
    """The tool schemas the chat template renders into each prompt, which its length counts (the
    prompt-length filter, ``common.prompts.prompts_within``): rollout.tools', an OpenEnv server's,
    a verifiers environment's (passed with its every call). An agent program's are its calls' own,
    known only as it makes them: not counted."""
    if environments is not None and environments.tool_schemas:
        return environments.tool_schemas
    return verifiers_envs.tool_schemas(config.rollout.environment, config.rollout.environment_args)
