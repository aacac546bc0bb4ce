"""What answers a turn: the one interface every kind of environment implements, and the values it
answers with. ``rollout.episodes`` drives any ``Environment`` the same way, whatever it is: a
user's environment and the run's tools (``environments.native``), an OpenEnv server's session, a
verifiers environment or an agent program (``environments.agents``).

An environment answers later: each call begins its work and returns a future at once, so the
rollout's engine loop never waits on one (a native environment's calls run in threads of their
own, ``environments.threads``; an agent program's answer comes from its program's own thread).
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass
class ToolError:
    """What went wrong with one call: its ``kind`` (``malformed``, ``unknown_tool``, ``raised``,
    ``unserialisable``: what ``tool_errors`` counts), the tool and arguments, and the detail
    (a raised error's traceback) for the rollout's log."""
    kind: str
    tool: str | None
    arguments: dict
    detail: str


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
    """Text, or a list of text and image parts (``environments.tools.is_part``)."""
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


def is_part(part: Any) -> bool:
    """A message part tether shows: ``{"type": "text", "text": str}``, or an image part (``{"type":
    "image", ...}``, ``{"type": "image_url", ...}``; its image is read where it is rendered,
    ``common.images.part_image``)."""
    return isinstance(part, dict) and (part.get("type") in ("image", "image_url")
                                       or part.get("type") == "text" and isinstance(part.get("text"), str))


class PastDeadline(TimeoutError):
    """An environment past its own deadline (an agent program past ``rollout.agent_deadline_s``): its
    episode ends ``env_deadline`` as one whose answer the rollout's loop stops waiting for does,
    whichever of the two is seen first."""


@runtime_checkable
class Environment(Protocol):
    """What answers an episode's turns, as ``rollout.episodes`` drives it: one per episode, made by
    ``environments.native.Environments.make`` from the episode's data row. Each ``begin_*`` returns
    at once; its future holds the answer or the error that ends the episode (``env_error``;
    ``PastDeadline``: ``env_deadline``)."""

    tools: list[dict] | None  # the tool schemas its prompts render (its own: an agent program's calls); None: the run's
    deadline: float  # the monotonic time its whole episode must end by (an agent program's); math.inf: none

    @property
    def turn_max_tokens(self) -> int | None:
        """What the turn under way may have at most, where the environment asks for fewer tokens than
        the run allows (an agent program's call, its ``max_tokens``); None: the run's."""

    def begin_reset(self) -> Future:
        """The episode starts: a future of its first ``Observation`` (None: the data row's prompt)."""

    def begin_step(self, response: str, messages: list[dict], turn: Turn | None = None) -> Future:
        """The policy's ``turn`` (its text ``response``, the conversation so far ``messages``) is
        answered: a future of the ``Step``. The engine always gives ``turn``; None (a test's) is
        the text alone."""

    def begin_last(self, response: str, messages: list[dict], turn: Turn | None = None) -> Future | None:
        """A turn the run cut at ``rollout.max_new_tokens``, the episode's last: a future of its
        ``Step``, whose reward counts and whose episode ends "length" whatever it says (an agent
        program's call is answered with it); None where nothing answers it: the episode ends now."""

    def close(self) -> Future | None:
        """The episode is over (or the run): what it holds is let go (a session, a program's waiting
        call), without blocking; a future of that where it takes a while, else None."""
