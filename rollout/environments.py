"""Environments: what answers the policy's turns in an episode.

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
when there is none. Both are called in the rollout's worker threads, never on the engine's loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from common import verifiers_envs
from common.config import ConfigError, TetherConfig
from common.functions import load_function
from common.prompts import chat_of, text_chat
from rollout import openenv
from rollout.tools import Tool, ToolCallParser, ToolError, call_tool, is_part


class TokenIds(list):
    """An observation of token ids, appended as they are, past the chat template (an agent
    program's completions call: the ids of what it added to its prompt). ``unsaid``: how many of
    the policy's last ids the program's transcript leaves out (the stop token a completion's text
    omits, which the program did not write back): they leave the episode's stream, so that the
    stream is what the program's transcript tokenizes to."""

    def __init__(self, ids=(), unsaid: int = 0) -> None:
        super().__init__(ids)
        self.unsaid = unsaid


@dataclass
class Restart:
    """An observation that starts the episode's context over (an agent program that rewrote or
    compacted its conversation): ``first`` is the new context's start, rendered as a reset's; the
    episode's tokens so far become a part of their own and its next part starts there
    (rollout.episodes, ``episode_splits``)."""
    first: "str | list[dict] | TokenIds"


Observation = str | list[dict] | TokenIds | Restart | None


class EnvironmentFailing(RuntimeError):
    """``rollout.env_failure_limit`` episodes in a row ended by their environment: the run ends
    (exit code 4), since every later episode would fail the same way."""


class BadStep(ValueError):
    """An environment returned something that is not a step (its episode ends: ``env_error``)."""


@dataclass
class Step:
    observation: Observation = None
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0  # calls answered in this step
    tool_errors: list[ToolError] = field(default_factory=list)  # what went wrong with each call that failed
    metrics: dict[str, float] = field(default_factory=dict)  # an agent program's figures of its episode


@dataclass
class Turn:
    """The policy's turn as the engine gave it, for an environment that answers with its tokens (an
    agent program's, whose reply carries logprobs): the ids it continued, and its own ids and logprobs."""
    prompt_length: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"  # "length": cut at the call's own max_tokens


def as_step(value: Any) -> Step:
    """An environment's answer as a ``Step``; anything else is a ``BadStep`` saying what it was.
    Types are taken as they are, never coerced: ``done="False"`` would be true and ``reward="0.5"``
    a string an environment meant as something else, so both are refused, as is a dict that lacks
    one of the three keys (``{}`` would be a step that says nothing)."""
    if isinstance(value, Step):
        step = value
    elif isinstance(value, dict):
        keys = {"observation", "reward", "done"}
        if set(value) != keys:
            missing, extra = sorted(keys - set(value)), sorted(set(value) - keys)
            raise BadStep("step returned a dict " + "; ".join(
                part for part in (f"without {', '.join(missing)}" if missing else "",
                                  f"with unknown keys {', '.join(map(str, extra))}" if extra else "") if part)
                          + ": expected the keys observation, reward and done")
        step = Step(value["observation"], value["reward"], value["done"])
    elif isinstance(value, tuple) and len(value) == 3:
        step = Step(*value)
    else:
        raise BadStep(f"step returned {type(value).__name__}: expected Step(observation, reward, done), "
                      "a 3-tuple or a dict of those keys")
    check_observation(step.observation)
    # a number is what converts itself (int, float, numpy's, a 0-d tensor); text converts only by parsing
    if isinstance(step.reward, (bool, np.bool_)) or not hasattr(type(step.reward), "__float__"):
        raise BadStep(f"step's reward is {step.reward!r} ({type(step.reward).__name__}), not a number")
    try:
        step.reward = float(step.reward)
    except (TypeError, ValueError) as error:  # a tensor of several elements
        raise BadStep(f"step's reward is {step.reward!r:.80}, not one number ({error})") from None
    if not math.isfinite(step.reward):
        raise BadStep(f"step's reward is {step.reward}")
    if not isinstance(step.done, (bool, np.bool_)):
        raise BadStep(f"step's done is {step.done!r} ({type(step.done).__name__}), not True or False")
    step.done = bool(step.done)
    return step


def _is_content(content: Any) -> bool:
    """Text, or a list of text and image parts (``rollout.tools.is_part``)."""
    return isinstance(content, str) or isinstance(content, list) and all(map(is_part, content))


def check_observation(observation: Any) -> Observation:
    """Text, a list of ``{"role": str, "content": str | parts}`` messages, ``TokenIds`` or None; else
    ``BadStep``. A message's content may be a list of text and image parts (a policy that sees
    images reads the images)."""
    if observation is None or isinstance(observation, str):
        return observation
    if isinstance(observation, TokenIds) and all(isinstance(token, int) for token in observation):
        return observation
    if isinstance(observation, Restart) and observation.first is not None:
        check_observation(observation.first)
        return observation
    if isinstance(observation, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and _is_content(m.get("content"))
            for m in observation):
        return observation
    raise BadStep(f"an observation is text or a list of {{'role', 'content'}} messages (content: text or a list of "
                  f"text and image parts), not {observation!r:.200}")


class ToolEnvironment:
    """Answers a turn's tool calls with the tools' results (one tool message each); a turn without
    a call is the episode's answer: it goes to ``inner``'s step, or ends the episode."""

    reads_turns = True  # the calls are read in the turn's tokens (ToolCallParser.text_of), special tokens kept

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
    """An episode against an OpenEnv server (``rollout.environment: openenv:<url>``, rollout/openenv.py):
    a turn's tool calls are steps of ``call_tool`` and their results tool messages; a turn without
    one is a step of the text action (its observation the user's next message), or, on a server of
    tools alone, the episode's end. A data row's ``reset`` object goes with the reset."""

    reads_turns = True  # calls are read in the turn's tokens (ToolCallParser.text_of)

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
                 server: "openenv.OpenEnv | None" = None) -> None:
        """``server``: the OpenEnv server the factory's episodes play against, whose tools are theirs."""
        self.factory, self.tools, self.server = factory, tools, server
        self.parser: ToolCallParser | None = None  # read_calls_with's, once the tokenizer is there
        self.shows_images = False  # showing_images's
        # its environments answer by futures (``begin_reset``, ``begin_step``: an agent program's, whose
        # own thread gives the answer), made and called in the rollout's loop with no thread of their own
        # (but for a reset after a back-off)
        self.answers_later = False

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
        ``rollout.agents.AgentPrograms``, whose episodes are its program's calls; ``environment``
        ``openenv:<url>``: an OpenEnv server's episodes, each message's answer awaited at most
        ``step_deadline_s`` (``rollout.env_step_deadline_s``: past it the rollout ends the episode)."""
        if agent is not None:
            environments = Environments(agent.make, {})
            environments.answers_later = True
            return environments
        if environment is None and not tools:
            return None
        if verifiers_envs.environment_id(environment) is not None:
            raise ConfigError("rollout.environment: a verifiers environment's episodes are an agent program's "
                              "(rollout.agents.agent_programs); give Environments.load its programs")
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

    def make(self, row: dict) -> Any:
        inner = self.factory(row) if self.factory is not None else None
        if inner is not None and not self.tools:
            return inner
        if self.parser is None:
            raise RuntimeError("Environments.read_calls_with was not called: tool calls cannot be read")
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
