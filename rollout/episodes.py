"""Episodes: the policy's turns with an environment's observations between them, kept token for
token (docs/design.md, "Episodes").

Token in, token out: an episode's response is the ids vLLM sampled, turn after turn, with the
observations' ids between them as the policy's chat template renders them (``Renderer``), never a
re-tokenization of text. The policy's tokens carry vLLM's logprobs and a loss mask of 1, the
environment's a mask of 0 and no logprob; a turn's reward sits on its last policy token.

``Episodes`` is the bookkeeping the rollout's loop drives: ``start`` a group (the
``samples_per_prompt`` episodes of one prompt), take the turns ``ready`` to generate, hand each
finished turn to ``turn_finished``, ``advance`` the environment calls between engine steps, and
send the groups ``finished`` returns. Every kind of environment is driven alike, through
``environments.interface.Environment``: each call returns a future at once, waited on with a
deadline (``rollout.env_step_deadline_s``), so the engine never waits on one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import traceback
from array import array
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from common.config import ConfigError, TetherConfig
from common.image_prompts import images_shown, template_chat
from common.images import observation_images, pack_images
from common.processors import expand_placeholders, expanded_ids
from common.prompts import chat_of, content_text, text_chat
from protocol.samples import Sample
from environments.interface import BadStep, Environment, Observation, PastDeadline, Restart, Step, TokenIds, Turn
from environments.native import Environments
from environments.threads import in_thread

# a chat both renders of an observation start with, so its ids are the observation's alone (Renderer);
# the reply is text no template writes itself, so where the assistant's turn ends can be found after it
_REPLY = "tether-reply"
_BASE_CHAT = [{"role": "user", "content": "."}, {"role": "assistant", "content": _REPLY}]


class Renderer:
    """Token ids of what the environment says, the way the policy sees it: through the policy's
    chat template where it has one, else as plain text. A policy that sees images (its
    ``processor``) is rendered through the processor's template, each image part a placeholder
    (unexpanded: vLLM expands it, ``Episodes._sample`` expands the sample's)."""

    def __init__(self, tokenizer, tools: list[dict] | None, processor=None) -> None:
        self.tokenizer, self.tools, self.processor = tokenizer, tools, processor
        self.template = processor if processor is not None else tokenizer
        self.chat = bool(getattr(self.template, "chat_template", None))
        if self.chat:
            try:
                self.base = self._render(_BASE_CHAT, generation_prompt=False)
            except Exception as error:  # a template that takes no user/assistant chat cannot carry episodes
                raise ConfigError(f"models.policy: its chat template cannot render a user turn and an assistant "
                                  f"turn ({type(error).__name__}: {error}); episodes need one that can") from None
            # how the template ends an assistant turn ("<|im_end|>\n" in ChatML, "<|eot_id|>" in Llama 3)
            self.turn_end = self.base[self.base.rindex(_REPLY) + len(_REPLY):]
            self.special = {*tokenizer.all_special_ids, *tokenizer.get_added_vocab().values()}

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        messages = template_chat(messages) if self.processor is not None else text_chat(messages)
        return self.template.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                 add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _text(self, messages: list[dict]) -> str:
        """Messages without a chat template: their contents a line each (an image as its placeholder),
        a tool's result inside ``<tool_response>`` as Hermes-style templates write it."""
        def content(message: dict) -> str:
            if isinstance(message["content"], str) or self.processor is None:
                return content_text(message["content"])
            return "".join(self.processor.image_token if part["type"] in ("image", "image_url") else part["text"]
                           for part in message["content"])

        return "\n".join(f"<tool_response>\n{content(m)}\n</tool_response>" if m["role"] == "tool" else content(m)
                         for m in messages)

    def images_of(self, messages: list[dict], ids: list[int]) -> list[bytes]:
        """The encoded images ``messages`` show, in order, which rendered to ``ids``: a ``BadStep``
        where the policy does not see images, an image part holds no image, or the text holds a
        placeholder of its own (it would take an image's slot)."""
        shown = images_shown(template_chat(messages))
        if self.processor is None:
            if shown:
                raise BadStep(f"the environment shows {shown} image(s) and the policy does not see images (its "
                              "config has no vision tower)")
            return []
        try:
            images = observation_images(messages)
        except ValueError as error:
            raise BadStep(str(error)) from None
        if ids.count(self.placeholder) != len(images):
            raise BadStep(f"the environment's messages render to {ids.count(self.placeholder)} image placeholder(s) "
                          f"({self.processor.image_token!r}) for their {len(images)} image(s): its text may not hold "
                          "the placeholder itself, and the chat template must show every image part")
        return images

    @property
    def placeholder(self) -> int | None:
        """A policy that sees: its image placeholder's id."""
        return None if self.processor is None else self.tokenizer.convert_tokens_to_ids(self.processor.image_token)

    def token_ids(self, ids: list[int]) -> list[int]:
        """An observation's token ids; a ``BadStep`` where they hold an image placeholder (token ids
        of an observation come without images: a placeholder would be an image slot without one)."""
        if self.processor is not None and self.placeholder in ids:
            raise BadStep(f"an observation's token ids hold the image placeholder ({self.processor.image_token!r}) "
                          f"{ids.count(self.placeholder)} time(s) for 0 image(s)")
        return ids

    def prompt_ids(self, first: Observation) -> list[int]:
        """An episode's start from an environment's ``reset``, by the rule of every observation: text
        is a user message, and messages go through the template with the generation prompt; without
        a template, the text as a text prompt is tokenized (with the tokenizer's special tokens)."""
        if isinstance(first, str):
            first = [{"role": "user", "content": first}]
        if not self.chat:
            return list(self.tokenizer(self._text(first))["input_ids"])
        return self._ids(self._render(first, generation_prompt=True))

    def observation_ids(self, messages: list[dict], last_token: int) -> list[int]:
        """The ids between the policy's turn, whose last token was ``last_token``, and its next one:
        the template's end of an assistant turn (less the token the policy stopped at, when the end
        begins with it: ChatML's "\n" after "<|im_end|>"), ``messages`` (the environment's) and the
        next turn's generation prompt."""
        if not self.chat:
            return self._ids(self._text(messages))
        full = self._render([*_BASE_CHAT, *messages], generation_prompt=True)
        if not full.startswith(self.base):
            raise BadStep("the chat template renders a conversation differently once an observation follows it; "
                          "its ids cannot be appended to the policy's")
        closing, stop = self.turn_end, self.tokenizer.convert_ids_to_tokens(last_token)
        if last_token in self.special and closing.startswith(stop):
            closing = closing[len(stop):]
        return self._ids(closing + full[len(self.base):])


@dataclass
class Group:
    """The ``samples_per_prompt`` episodes of one prompt: they travel to the buffer together."""
    prompt_index: int
    data_row: int
    episodes: list["Episode"] = field(default_factory=list)


@dataclass
class Episode:
    group: Group
    environment: Environment | None = None
    started: bool = False  # its reset answered: its environment answers turns now
    prompt_tokens: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the conversation, for environments and rewards
    tokens: list[int] = field(default_factory=list)  # after the prompt: the policy's and the environment's
    logprobs: list[float] = field(default_factory=list)  # vLLM's at the policy's tokens, 0 at the environment's
    loss_mask: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turns: int = 0
    behavior_version: int | None = None  # of its first policy token
    last_behavior_version: int | None = None  # of its last
    # why it ended: "length" (a turn cut at max_new_tokens), "done", "max_turns", "token_budget",
    # "env_error", "env_deadline"; the rollout's metrics count each
    ended: str | None = None
    pending: Future | None = None  # the environment call under way, if any
    deadline: float = 0.0
    last_token: int = -1  # of the policy's last turn: the token it stopped at, when it stopped
    tool_calls: int = 0
    tool_errors: int = 0
    renderer: Renderer | None = None  # for an episode whose environment brings its own tools
    call_cap: int | None = None  # the turn under way: an agent's call asked for fewer tokens than the run allows
    deadline_said: str = ""  # which deadline ``deadline`` is, as the failure log says it
    cut: bool = False  # its last turn was cut at rollout.max_new_tokens: it ends "length" (an agent's, once it returns)
    index: int = 0  # its place in its group
    # the token streams it left behind (an agent program rewrote its context): samples of their own
    parts: list[Sample] = field(default_factory=list)
    # a policy that sees: the images shown so far (the prompt's, then the observations'), encoded, one
    # for each placeholder of prompt_tokens + tokens in order; and the tokens their expansion adds
    images: list[bytes] = field(default_factory=list)
    image_tokens: int = 0
    engine_prompt: list[int] | None = None  # the expanded ids vLLM reported for the last turn's prompt

    @property
    def length(self) -> int:
        """Its tokens as the engine counts them: each image expanded."""
        return len(self.prompt_tokens) + len(self.tokens) + self.image_tokens


def _shown(observation: str | list[dict] | None) -> list[dict]:
    """An observation of text or messages as the messages the template renders: text as a user's."""
    return [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation or [])


def _reset_after(delay_s: float, environment: Environment, deadline_s: float) -> Observation:
    """``environment``'s reset after ``delay_s`` (backing off from environments that keep failing,
    ``Episodes.backoff_s``), waited on here for ``deadline_s`` at most."""
    time.sleep(delay_s)
    return environment.begin_reset().result(timeout=deadline_s)


def _begun(begin: Callable[..., Future | None], *arguments: Any) -> Future | None:
    """``begin(*arguments)``'s future (None where it gives none), or one of its error."""
    try:
        return begin(*arguments)
    except BaseException as error:
        return _failed(error)


def _failed(error: BaseException) -> Future:
    failed: Future = Future()
    failed.set_exception(error)
    return failed


class FailureLog:
    """Each distinct failure (its kind, error type and where it was raised) logged once, whole, with
    its traceback and data row; its repeats counted and said at 10, 100, 1000... times, so an
    environment that fails every episode writes a few lines, not a line an episode."""

    def __init__(self, log: logging.Logger) -> None:
        self.log, self.seen = log, Counter()

    def report(self, kind: str, error: BaseException | None, summary: str, detail: str, where: tuple = ()) -> None:
        """``kind``: what failed (``env_error``, ``tool raised``...); ``summary``: one line;
        ``detail``: what a reader needs the first time (the traceback, the row)."""
        if error is not None:  # one raised in another process (an agent program's) says where itself
            frames = traceback.extract_tb(error.__traceback__)
            raised_at = getattr(error, "where", None) or ((frames[-1].filename, frames[-1].lineno) if frames else ())
            where = (*where, type(error).__name__, *raised_at)
        key = (kind, *where)
        self.seen[key] += 1
        count = self.seen[key]
        if count == 1:
            self.log.error("%s: %s (logged once; its repeats are counted)\n%s", kind, summary, detail.rstrip())
        elif math.log10(count).is_integer():
            self.log.warning("%s: %s: %d times so far", kind, summary, count)

    @staticmethod
    def traceback_of(error: BaseException) -> str:
        return "".join(traceback.format_exception(type(error), error, error.__traceback__))


class EnvironmentFailing(RuntimeError):
    """``rollout.env_failure_limit`` episodes in a row ended by their environment: the run ends
    (exit code 4), since every later episode would fail the same way."""


# an environment's failures in a row before new episodes wait, and how long at most
BACKOFF_AFTER, BACKOFF_FIRST_S, BACKOFF_MAX_S = 4, 0.1, 5.0
FAILED_ENDINGS = ("env_error", "env_deadline")
CLOSE_DEADLINE_S = 5.0  # the run's end: how long the environments of episodes under way may take to close
EXPANSIONS_KEPT = 4096  # images whose expanded ids an engine's episodes keep (4 bytes an id: under 64 MB)


class Episodes:
    """Every episode of one rollout engine, from its grant to its samples."""

    def __init__(self, config: TetherConfig, environments: Environments, renderer: Renderer, tokenizer,
                 rows: list[dict], prompts: list[list[int]], data_rows: list[int],
                 sampling_for: Callable[["Episode", int], object], log: logging.Logger,
                 images: list[list[bytes]] | None = None) -> None:
        """``prompts``, ``data_rows``: the kept prompts' ids and their rows of ``rows`` (the data file);
        ``sampling_for(episode, max_tokens)``: vLLM's sampling of the episode's next turn; ``images``:
        a policy that sees (``renderer.processor``): each kept prompt's images."""
        self.config, self.environments, self.renderer, self.tokenizer = config, environments, renderer, tokenizer
        self.images = images
        self.expansions: dict[bytes, array] = {}  # an image's ids, expanded (image_expansion)
        self.renderers: dict[str, Renderer] = {}  # by the tools they render, for environments with their own
        self.sampling_for = sampling_for
        self.rows, self.prompts, self.data_rows, self.log = rows, prompts, data_rows, log
        self.groups: list[Group] = []
        self.ready: list[Episode] = []  # waiting to generate their next turn
        self.waiting: list[Episode] = []  # waiting on their environment
        self.counters: Counter = Counter()  # since the last metrics record
        self.endings: Counter = Counter()  # every episode's ending since the start, by reason
        self.failures = FailureLog(log)
        self.failed_in_a_row = 0  # episodes ended by their environment since the last that ended well

    def start(self, prompt_index: int, row: int) -> None:
        """The episodes of the prompt at ``row`` of the kept prompts: each makes its environment and
        begins its reset (in a thread of its own where it first backs off from failures)."""
        group = Group(prompt_index, self.data_rows[row])
        self.groups.append(group)
        data_row = self.rows[group.data_row]
        for index in range(self.config.rollout.samples_per_prompt):
            episode = Episode(group, index=index, prompt_tokens=list(self.prompts[row]),
                              messages=text_chat(chat_of(data_row, self.config.data.system_prompt)
                                                 or [{"role": "user", "content": data_row.get("prompt", "")}]))
            if self.images:
                self._show(episode, self.images[row])
            group.episodes.append(episode)
            delay = self.backoff_s()
            try:
                episode.environment = self.environments.make(data_row)
            except Exception as error:
                self._wait_on(episode, _failed(error))
                continue
            self._wait_on(episode, in_thread(_reset_after, delay, episode.environment,
                                             self.config.rollout.env_step_deadline_s + delay) if delay
                          else _begun(episode.environment.begin_reset))
            episode.deadline += delay

    def renderer_for(self, tools: list[dict] | None) -> Renderer:
        """The renderer of an episode whose environment names its own tools (an agent program's
        calls pass theirs): their schemas in the template's system prompt; else the run's."""
        if not tools or tools == self.renderer.tools:
            return self.renderer
        key = json.dumps(tools, sort_keys=True)
        if key not in self.renderers:
            self.renderers[key] = Renderer(self.tokenizer, tools, self.renderer.processor)
        return self.renderers[key]

    def backoff_s(self) -> float:
        """How long a new episode waits before its environment is made: 0 until BACKOFF_AFTER
        episodes in a row failed, then doubling from BACKOFF_FIRST_S to BACKOFF_MAX_S."""
        if self.failed_in_a_row < BACKOFF_AFTER:
            return 0.0
        return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self.failed_in_a_row - BACKOFF_AFTER))

    @property
    def active(self) -> int:
        """Groups under way: the prompts that hold the engine's room."""
        return len(self.groups)

    def take_ready(self, version: int) -> list[tuple[Episode, list[int], object]]:
        """(episode, the ids its next turn continues, that turn's sampling) for each episode to
        generate a turn of now, with weights of ``version``; a turn may have at most
        ``max_new_tokens`` and what ``max_model_len`` leaves."""
        ready, self.ready = self.ready, []
        turns = []
        for episode in ready:
            if episode.behavior_version is None:
                episode.behavior_version = version
            ids = episode.prompt_tokens + episode.tokens
            # an agent program's call may ask for fewer tokens than the run's turns have
            asked = episode.environment.turn_max_tokens or self.config.rollout.max_new_tokens
            limit = min(self.config.rollout.max_new_tokens, self.config.rollout.max_model_len - episode.length)
            episode.call_cap = asked if asked < limit else None
            turns.append((episode, ids, self.sampling_for(episode, min(limit, asked))))
        return turns

    def turn_finished(self, episode: Episode, output, version: int) -> None:
        """A turn of ``episode`` came out of vLLM (a finished request), its last token generated with
        weights of ``version``. The environment answers it, unless vLLM cut it."""
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        if episode.images:  # what vLLM expanded, for _sample to check its own expansion against
            episode.engine_prompt = list(output.prompt_token_ids)
        episode.tokens += tokens
        episode.logprobs += [entry[token].logprob for entry, token in zip(completion.logprobs, tokens)]
        episode.loss_mask += [1] * len(tokens)
        episode.turn_rewards += [0.0] * len(tokens)
        episode.turns += 1
        episode.last_behavior_version = version
        episode.last_token = tokens[-1]
        response = self.tokenizer.decode(tokens, skip_special_tokens=True)
        episode.messages = [*episode.messages, {"role": "assistant", "content": response}]
        # a turn cut where the run cuts turns ends its episode; one cut at its call's own max_tokens
        # is that call's answer (finish_reason "length"), and the program goes on
        cut_by_call = episode.call_cap is not None and len(tokens) >= episode.call_cap
        episode.cut = completion.finish_reason == "length" and not cut_by_call
        turn = Turn(len(episode.prompt_tokens) + len(episode.tokens) - len(tokens), tokens,
                    episode.logprobs[-len(tokens):], completion.finish_reason or "stop")
        # a cut turn is the episode's last; its environment may still answer it (an agent program's
        # call, finish_reason "length"), and the episode ends "length" with what that says
        begin = episode.environment.begin_last if episode.cut else episode.environment.begin_step
        pending = _begun(begin, response, episode.messages, turn)
        if pending is None:  # nothing answers a cut turn (a native environment's): the episode ends with it
            return self._end(episode, "length")
        self._wait_on(episode, pending)

    def advance(self, now: float, timeout: float = 0.0) -> None:
        """Take in what environments answered, waiting up to ``timeout`` for a first answer (the loop
        passes one when the engine has nothing to do), and end the episodes past their deadline."""
        pending = [e.pending for e in self.waiting]
        if timeout > 0 and pending:
            wait(pending, timeout=min(timeout, max(0.0, min(e.deadline for e in self.waiting) - now)),
                 return_when=FIRST_COMPLETED)
            now = time.monotonic()
        still = []
        for episode in self.waiting:
            if episode.pending.done():
                future, episode.pending = episode.pending, None
                self._answered(episode, future)
            elif now >= episode.deadline:  # its environment is closed as it ends (one still being made, once made)
                episode.pending = None
                self._past_deadline(episode, episode.deadline_said)
            else:
                still.append(episode)
        self.waiting = still

    def finished(self) -> tuple[list[Sample], list[tuple[int, str]]]:
        """The groups whose episodes have all ended: their samples (an episode's parts in order, its
        last part last, each numbered), and the episodes that could not be sent, (prompt index, why)
        each. A group with an episode the policy never spoke in (its environment failed before the
        first turn) is not sent at all: a batch holds whole groups."""
        samples, dropped, still = [], [], []
        trains_failed = self.config.rollout.failed_episode_reward is not None
        for group in self.groups:
            if any(e.ended is None for e in group.episodes):
                still.append(group)
                continue
            episodes = [self._parts(e) for e in group.episodes]
            if all(episodes) and (trains_failed or not any(e.ended in FAILED_ENDINGS for e in group.episodes)):
                samples += [part for parts in episodes for part in parts]
            else:  # a failed episode's reward is not known: its group is not trained (failed_episode_reward)
                dropped += [(group.prompt_index, e.ended if not parts or e.ended in FAILED_ENDINGS
                             else "group_incomplete") for e, parts in zip(group.episodes, episodes)]
        self.groups = still
        return samples, dropped

    def _parts(self, episode: Episode) -> list[Sample]:
        """An ended episode's samples: the parts it left behind and its last token stream, if the
        policy spoke in it (a context rewritten and then ended before its first turn leaves none:
        the part before is the last, and ends as the episode did)."""
        parts = episode.parts + ([self._sample(episode)] if episode.tokens else [])
        if parts:
            parts[-1].finish_reason = episode.ended
            failed_reward = self.config.rollout.failed_episode_reward
            if episode.ended in FAILED_ENDINGS and failed_reward is not None:  # on its last token, a policy token
                parts[-1].turn_rewards[-1] += failed_reward
        for number, part in enumerate(parts):
            part.episode_index, part.part_index, part.episode_parts = episode.index, number, len(parts)
        return parts

    def _wait_on(self, episode: Episode, pending: Future) -> None:
        """``episode`` waits on its environment's answer ``pending``, for ``env_step_deadline_s`` at
        most, and no later than its environment's own deadline for the whole episode (an agent
        program's ``agent_deadline_s``)."""
        episode.pending = pending
        rollout = self.config.rollout
        whole = episode.environment.deadline if episode.environment is not None else math.inf
        step_deadline = time.monotonic() + rollout.env_step_deadline_s
        episode.deadline = min(step_deadline, whole)
        episode.deadline_said = (f"the agent program did not return within {rollout.agent_deadline_s:g}s of its start "
                                 "(rollout.agent_deadline_s)" if whole < step_deadline else
                                 f"the environment did not answer within {rollout.env_step_deadline_s:g}s "
                                 "(rollout.env_step_deadline_s)")
        self.waiting.append(episode)

    def _past_deadline(self, episode: Episode, why: str) -> None:
        """``episode`` ends ``env_deadline``: ``why``, in the failure log (one whose last turn was cut
        ends "length" all the same: ``_end``)."""
        self.failures.report("env_deadline", None, f"{why}; the episode ends", self._row_text(episode),
                             ("step" if episode.started else "reset",))
        self._end(episode, "env_deadline")

    def _answered(self, episode: Episode, future: Future) -> None:
        error = future.exception()
        if isinstance(error, PastDeadline):  # the program's own deadline, seen before the loop's
            self._past_deadline(episode, str(error))
        elif error is not None:
            call = "step" if episode.started else "reset"
            self.failures.report("env_error", error, f"the environment's {call} failed ({type(error).__name__}: "
                                 f"{error}); the episode ends",
                                 f"{self._row_text(episode)}\n{FailureLog.traceback_of(error)}", (call,))
            self._end(episode, "env_error")
        elif not episode.started:  # the reset
            episode.started, first = True, future.result()
            if first is not None:
                self._start_from(episode, first)
            else:
                self.ready.append(episode)
        else:
            self._stepped(episode, future.result())

    def _start_from(self, episode: Episode, first: Observation) -> None:
        episode.messages = self._as_messages(first)
        episode.images, episode.image_tokens, episode.engine_prompt = [], 0, None  # the reset's replace the row's
        try:
            episode.renderer = self.renderer_for(episode.environment.tools)
            if isinstance(first, TokenIds):
                episode.prompt_tokens = episode.renderer.token_ids(list(first))
            else:
                episode.prompt_tokens = episode.renderer.prompt_ids(first)
                self._show(episode, self._images(episode, _shown(first), episode.prompt_tokens))
        except Exception as error:  # the template refuses the environment's chat
            self.failures.report("env_error", error, f"the environment's first messages do not render "
                                 f"({type(error).__name__}: {error})",
                                 f"{self._row_text(episode)}\n{FailureLog.traceback_of(error)}", ("render",))
            return self._end(episode, "env_error")
        if episode.length >= self.config.rollout.max_model_len:
            return self._end(episode, "token_budget")
        self.ready.append(episode)

    def _stepped(self, episode: Episode, step: Step) -> None:
        if isinstance(step.observation, TokenIds) and step.observation.unsaid:
            self._unsay(episode, step.observation.unsaid)
        if step.reward:
            episode.turn_rewards[-1] += step.reward  # a step answers a turn: the last token is the turn's
        episode.tool_calls += step.tool_calls
        episode.tool_errors += len(step.tool_errors)
        for name, figure in step.metrics.items():  # an agent program's: mean over the episodes that gave it
            self.counters[f"agent_{name}"] += figure
            self.counters[f"agent_{name}:episodes"] += 1
        for error in step.tool_errors:
            self.failures.report(f"tool {error.kind}", None, f"{error.tool or 'a tool call'} failed "
                                 "(the policy reads the error as the tool's answer)",
                                 f"arguments: {json.dumps(error.arguments)}\n{error.detail}", (error.tool,))
        if step.done:
            return self._end(episode, "done")
        if episode.turns >= self.config.rollout.max_turns:
            return self._end(episode, "max_turns")
        if isinstance(step.observation, Restart):
            return self._restart(episode, step.observation.first)
        images: list[bytes] = []
        try:
            if isinstance(step.observation, TokenIds):
                ids = (episode.renderer or self.renderer).token_ids(list(step.observation))
            else:
                shown = _shown(step.observation)
                ids = (episode.renderer or self.renderer).observation_ids(shown, episode.last_token)
                images = self._images(episode, shown, ids)
        except Exception as error:
            self.failures.report("env_error", error, f"an observation does not render ({type(error).__name__}: "
                                 f"{error})", f"{self._row_text(episode)}\n{FailureLog.traceback_of(error)}",
                                 ("render",))
            return self._end(episode, "env_error")
        # the next turn needs room for at least one token
        if episode.length + len(ids) + self._image_tokens(images) >= self.config.rollout.max_model_len:
            return self._end(episode, "token_budget")
        episode.tokens += ids
        episode.logprobs += [0.0] * len(ids)
        episode.loss_mask += [0] * len(ids)
        episode.turn_rewards += [0.0] * len(ids)
        self._show(episode, images)
        episode.messages = [*episode.messages, *self._as_messages(step.observation)]
        self.ready.append(episode)

    @staticmethod
    def _unsay(episode: Episode, count: int) -> None:
        """The policy's last ``count`` tokens leave the episode's stream: the program's transcript
        left them out (``TokenIds.unsaid``), and the next turn continues that transcript. The turn
        keeps a token at least (``environments.agents._unsaid``): its reward has a token to sit on."""
        for column in (episode.tokens, episode.logprobs, episode.loss_mask, episode.turn_rewards):
            del column[-count:]
        episode.last_token = episode.tokens[-1]

    def _images(self, episode: Episode, shown: list[dict], ids: list[int]) -> list[bytes]:
        """The images ``shown`` (an observation's messages, rendered to ``ids``) shows, each expanded
        once (``image_expansion``); a ``BadStep`` where the episode would show more than
        ``rollout.max_images_per_episode`` (vLLM's limit a prompt, set at the engine's start)."""
        images = (episode.renderer or self.renderer).images_of(shown, ids)
        limit = self.config.rollout.max_images_per_episode
        if len(episode.images) + len(images) > limit:
            raise BadStep(f"the episode would show {len(episode.images) + len(images)} images, past "
                          f"rollout.max_images_per_episode ({limit})")
        for image in images:
            self.image_expansion(image)
        return images

    def _show(self, episode: Episode, images: list[bytes]) -> None:
        """``images`` join the episode's, their expansion counted in its length."""
        episode.images += images
        episode.image_tokens += self._image_tokens(images)

    def _image_tokens(self, images: list[bytes]) -> int:
        """The tokens ``images`` add past their placeholders, once each is expanded."""
        return sum(len(self.image_expansion(image)) - 1 for image in images)

    def image_expansion(self, image: bytes) -> array:
        """The ids an image's placeholder expands into, as the processor (and vLLM) expands it, which
        depends on the image alone: computed once an image (by its digest; at most EXPANSIONS_KEPT)."""
        key = hashlib.sha1(image).digest()
        if key not in self.expansions:
            if len(self.expansions) >= EXPANSIONS_KEPT:
                del self.expansions[next(iter(self.expansions))]
            processor = self.renderer.processor
            self.expansions[key] = array("i", expanded_ids(processor, processor.image_token, [image], False))
        return self.expansions[key]

    def _expanded(self, episode: Episode) -> tuple[list[int], list[int], tuple[list, ...]]:
        """The episode's prompt and tokens with each image's placeholder expanded, and its logprobs,
        loss mask and turn rewards with a 0 at each image's ids: what vLLM computed its turns on and
        what the scorer and the learner read. A ``RuntimeError`` where vLLM's own expansion of the last
        turn's prompt differs (a family whose image ids depend on more than the image)."""
        processor, placeholder = self.renderer.processor, self.renderer.placeholder
        expansions = [list(self.image_expansion(image)) for image in episode.images]
        in_prompt = episode.prompt_tokens.count(placeholder)
        prompt, _ = expand_placeholders(episode.prompt_tokens, placeholder, expansions[:in_prompt])
        tokens, columns = expand_placeholders(episode.tokens, placeholder, expansions[in_prompt:],
                                              (episode.logprobs, episode.loss_mask, episode.turn_rewards))
        engine = episode.engine_prompt
        if engine is not None and (prompt + tokens)[:len(engine)] != engine:
            raise RuntimeError(f"vLLM expanded an episode's images into other ids than {type(processor).__name__} "
                               "expands each image alone: episodes with images are not built for this family")
        return prompt, tokens, columns

    def _restart(self, episode: Episode, first: Observation) -> None:
        """The episode's context starts over (an agent program rewrote its conversation): its token
        stream so far becomes a part of its own (``finish_reason`` "restart"), trained as the same
        episode, and the next part is the new context's prompt and the turns after it (its turns
        count on, its reward still comes at its end, on its last part). ``episode_splits`` counts
        the parts so made."""
        self.counters["episode_splits"] += 1
        episode.parts.append(self._sample(episode, "restart"))
        episode.tokens, episode.logprobs, episode.loss_mask, episode.turn_rewards = [], [], [], []
        episode.behavior_version = None
        self._start_from(episode, first)

    def _as_messages(self, observation: Observation) -> list[dict]:
        """An observation as the conversation's messages (what reward functions and the reward model
        read): text and token ids as a user's turn, a message's text parts as its text (images left out)."""
        if isinstance(observation, TokenIds):
            text = self.tokenizer.decode(observation, skip_special_tokens=True)
            return [{"role": "user", "content": text}] if text else []
        return text_chat(_shown(observation))

    def _row_text(self, episode: Episode) -> str:
        row = self.rows[episode.group.data_row]
        shown = json.dumps(row, default=repr)[:2000]  # a dataset's row may hold what JSON does not (dates, bytes)
        return f"prompt {episode.group.prompt_index}, data row {episode.group.data_row}: {shown}"

    def _end(self, episode: Episode, reason: str) -> None:
        """``episode`` ends for ``reason``; one whose last turn was cut at max_new_tokens ends "length"
        whatever came after (an agent program's return, or its failure or lateness: never dropped as
        a failure would be, and learner.truncation_penalty applies)."""
        reason = "length" if episode.cut else reason
        episode.ended = reason
        self._close(episode)
        self.counters[f"ended_{reason}"] += 1
        self.endings[reason] += 1
        self.failed_in_a_row = self.failed_in_a_row + 1 if reason in FAILED_ENDINGS else 0
        limit = self.config.rollout.env_failure_limit
        if self.failed_in_a_row >= limit:
            raise EnvironmentFailing(
                f"{self.failed_in_a_row} episodes in a row ended by their environment ({', '.join(FAILED_ENDINGS)}) "
                f"and none ended well (rollout.env_failure_limit {limit}); the first of each failure is in the log "
                f"above with its traceback and data row. Ends so far: "
                + ", ".join(f"{reason} {count}" for reason, count in sorted(self.endings.items())))
        if episode.tokens or episode.parts:
            self.counters["episodes"] += 1
            self.counters["turns"] += episode.turns
            self.counters["tool_calls"] += episode.tool_calls
            self.counters["tool_errors"] += episode.tool_errors
            self.counters["env_reward"] += sum(episode.turn_rewards) + sum(float(part.turn_rewards.sum())
                                                                           for part in episode.parts)

    def _sample(self, episode: Episode, finish_reason: str | None = None) -> Sample:
        # an observation is appended only when a turn follows it: the episode ends on a policy token
        prompt, tokens = episode.prompt_tokens, episode.tokens
        logprobs, loss_mask, turn_rewards = episode.logprobs, episode.loss_mask, episode.turn_rewards
        if episode.images:
            prompt, tokens, (logprobs, loss_mask, turn_rewards) = self._expanded(episode)
        return Sample(
            sample_id="", prompt_index=episode.group.prompt_index, behavior_version=episode.behavior_version,
            last_behavior_version=episode.last_behavior_version,
            prompt_tokens=np.asarray(prompt, dtype=np.int32),
            response_tokens=np.asarray(tokens, dtype=np.int32),
            behavior_logprobs=np.asarray(logprobs, dtype=np.float32),
            finish_reason=finish_reason or episode.ended, data_row=episode.group.data_row,
            loss_mask=np.asarray(loss_mask, dtype=np.uint8),
            turn_rewards=np.asarray(turn_rewards, dtype=np.float32),
            messages=json.dumps(episode.messages),
            images=pack_images(episode.images) if episode.images else None)

    def close(self) -> None:
        """The run is over: the environments of the episodes still under way are closed (an OpenEnv
        session ended as its server expects, in a thread; an agent program's waiting call refused),
        what takes a while waited on ``CLOSE_DEADLINE_S`` at most in all."""
        under_way = [episode for group in self.groups for episode in group.episodes if episode.ended is None]
        closing = [future for episode in under_way if (future := self._close(episode)) is not None]
        wait(closing, timeout=CLOSE_DEADLINE_S)

    def _close(self, episode: Episode) -> Future | None:
        """``episode``'s environment let go (an agent program's waiting call refused, a session
        ended); a close that raises is the failure log's, not the loop's."""
        if episode.environment is None:
            return None
        try:
            return episode.environment.close()
        except Exception as error:
            self.failures.report("close", error, f"the environment's close failed ({type(error).__name__}: {error})",
                                 f"{self._row_text(episode)}\n{FailureLog.traceback_of(error)}", ("close",))
            return None

    def record(self) -> dict:
        """The metrics since the last record: episodes ended (by reason), turns and tool calls per
        episode, tool errors, the environment's reward per episode, an agent program's figures
        (``agent_<name>``, their mean)."""
        counters, self.counters = self.counters, Counter()
        record = {**{f"episodes_{name}": counters[name] for name in counters if name.startswith("ended_")},
                  "episodes": counters["episodes"], "tool_errors": counters["tool_errors"]}
        if counters["episode_splits"]:
            record["episode_splits"] = counters["episode_splits"]
        record.update({name: counters[name] / counters[f"{name}:episodes"] for name in counters
                       if name.startswith("agent_") and not name.endswith(":episodes")})
        if counters["episodes"]:  # means over none would read as zeros on the dashboard
            record.update({f"{name}_per_episode": counters[name] / counters["episodes"] for name in ("turns", "tool_calls")},
                          env_reward=counters["env_reward"] / counters["episodes"])
        return record
