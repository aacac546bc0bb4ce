"""verifiers environments as tether's episodes (``rollout.environment: verifiers:<id>``).

A verifiers environment (``verifiers``' v0 API: ``load_environment(**args)`` returning a
``SingleTurnEnv``, ``ToolEnv``, ``MultiTurnEnv`` ... with its dataset, parser and ``Rubric``) runs
its own rollout against an OpenAI client. tether gives it one pointed at the rollout's endpoint
(an agent program, ``environments.agents``), so the environment's turns, tool calls, parsing and
stopping run as verifiers runs them while every token is the engine's, recorded by the endpoint;
the rubric's score is the episode's reward (a reward model or reward functions add to it) and its
metrics the episode's ``agent_<name>`` figures. An error the rollout recorded ends the episode
(``env_error``).

- ``data.prompts: verifiers:<id>`` is the environment's own dataset (``get_dataset()``;
  ``verifiers:<id>#eval`` its ``get_eval_dataset()``, for ``eval.prompts``): each row its fields,
  its chat prompt as ``messages``. A row of a file is given to the environment as its own dataset gives
  one: ``messages`` as they are (the environment's system prompt first where they have none), a
  text ``prompt`` as the user's question after the system prompt and few-shot messages.
- ``rollout.environment_args`` are ``load_environment``'s keywords.
- Every verifiers episode of a process runs in one event loop of its own, as verifiers' own
  ``generate()`` runs them, so what the environment made once (a judge's client) serves them all;
  a tool that blocks (a plain function that sleeps) holds up the others there too: write it async.
- Each process that reads the rows (the rollout, the scorer for reward functions, ``tether eval``)
  loads the environment itself and matches rows by position: its dataset must come out the same
  in each (a seeded shuffle, as verifiers' own are).
- The environment's sampling arguments go with its calls as its ``generate()`` sends them; the
  endpoint refuses (the episode's ``env_error`` says why) any that would change the run's
  distribution. A rubric that scores groups of rollouts, or has no reward function, is refused at
  load: an episode is scored alone, as it ends.
- Environments of verifiers 0.3 (the last release with this API; 0.4 runs environments of another
  shape in processes of their own). verifiers 0.3 pins ``mcp<2`` for its experimental MCPEnv
  alone, which vLLM's ``mcp>=2`` rules out: the ``verifiers`` extra names what else it needs, and
  verifiers itself installs with ``--no-deps`` (README).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import threading
from typing import Any

from common.verifiers_data import environment_id, load

MODEL = "policy"  # the model name the environment's calls carry: the endpoint serves the run's policy whatever it is


def tool_schemas(spec: str | None, args: dict[str, Any] | None = None) -> list[dict] | None:
    """The tools ``spec``'s environment (``rollout.environment``, made with ``args``) passes with
    every call, a ToolEnv's ``tool_defs``, as the rollout's endpoint receives and renders them: OpenAI
    function tools, unset keys left out. None for another spec or an environment without tools.
    The chat template renders them into each of its prompts, so a prompt's length counts them."""
    env_id = environment_id(spec)
    if env_id is None:
        return None
    tools = load(env_id, args).tool_defs or []
    return [{"type": "function", "function": tool.model_dump(exclude_none=True)} for tool in tools] or None


def rollout_input(environment, row: dict[str, Any]) -> dict[str, Any]:
    """``row`` as the environment's own dataset gives a row to its rollout: its fields, with
    ``prompt`` the chat (``messages``, after the environment's system prompt where they have
    none; a text ``prompt`` the user's question after its system prompt and few-shot messages)."""
    task = {key: value for key, value in row.items() if key != "messages"}
    if "messages" in row:
        messages = list(row["messages"])
        if environment.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": environment.system_prompt})
    else:
        messages = [{"role": "system", "content": environment.system_prompt}] if environment.system_prompt else []
        messages += [*(environment.few_shot or []), {"role": "user", "content": row["prompt"]}]
    task["prompt"] = messages
    task.setdefault("example_id", 0)
    return task


async def play(environment, client, row: dict[str, Any]) -> dict[str, float]:
    """One episode: the environment's rollout and rubric on ``row`` through ``client`` (an
    ``openai.AsyncOpenAI`` of the episode's key); its reward and metrics, the agent program's return.
    Run in the process's one loop for verifiers' episodes (``_episodes_loop``), as verifiers runs
    its own: what the environment made once (a judge's client, a semaphore) belongs to that loop,
    not to the program thread's that awaits it. Cancelled with its program (its deadline)."""
    episode = asyncio.run_coroutine_threadsafe(_rollout(environment, client, row), _episodes_loop())
    try:
        return await asyncio.wrap_future(episode)
    except asyncio.CancelledError:
        episode.cancel()
        raise


_LOOP: list[asyncio.AbstractEventLoop] = []  # the process's loop of verifiers' episodes, once made
_LOOP_LOCK = threading.Lock()  # program threads ask for it at once


def _episodes_loop() -> asyncio.AbstractEventLoop:
    with _LOOP_LOCK:
        if not _LOOP:
            _LOOP.append(asyncio.new_event_loop())
            threading.Thread(target=_LOOP[0].run_forever, name="verifiers-episodes", daemon=True).start()
        return _LOOP[0]


async def _rollout(environment, client, row: dict[str, Any]) -> dict[str, float]:
    import verifiers

    # the environment's sampling arguments, as its own generate() sends them (a call may cap its
    # turn; the endpoint refuses, saying why, what would change the run's distribution)
    output = await environment.run_rollout(rollout_input(environment, row), verifiers.OpenAIChatCompletionsClient(
        client), MODEL, copy.deepcopy(environment.sampling_args))
    if output.get("error"):
        raise RuntimeError(f"the verifiers rollout failed: {output['error']}")
    metrics = {name: float(value) for name, value in (output.get("metrics") or {}).items()
               if isinstance(value, (int, float)) and not isinstance(value, bool)}
    return {**metrics, "reward": float(output["reward"])}


def program(env_id: str, args: dict[str, Any] | None):
    """The agent program (``run(client, row)``, async) of ``verifiers:<env_id>``'s episodes."""
    return functools.partial(play, load(env_id, args))
