"""verifiers environments as tether's episodes (``rollout.environment: verifiers:<id>``).

A verifiers environment (``verifiers``' v0 API: ``load_environment(**args)`` returning a
``SingleTurnEnv``, ``ToolEnv``, ``MultiTurnEnv`` ... with its dataset, parser and ``Rubric``) runs
its own rollout against an OpenAI client. tether gives it one pointed at the rollout's endpoint
(an agent program, ``rollout.agents``), so the environment's turns, tool calls, parsing and
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
- Environments of verifiers 0.3 (the last release with this API; 0.4 runs environments of another
  shape in processes of their own). verifiers 0.3 pins ``mcp<2`` for its experimental MCPEnv
  alone, which vLLM's ``mcp>=2`` rules out: the ``verifiers`` extra names what else it needs, and
  verifiers itself installs with ``--no-deps`` (README).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from common.config import ConfigError

PREFIX = "verifiers:"
MODEL = "policy"  # the model name the environment's calls carry: the endpoint serves the run's policy whatever it is


EVAL = "#eval"  # data.prompts or eval.prompts verifiers:<id>#eval: the environment's eval dataset


def environment_id(spec: str | None) -> str | None:
    """The id in ``verifiers:<id>`` (or ``verifiers:<id>#eval``), or None for any other spec."""
    return spec.removeprefix(PREFIX).removesuffix(EVAL) if spec and spec.startswith(PREFIX) else None


def load(env_id: str, args: dict[str, Any] | None = None, key: str = "rollout.environment"):
    """The environment ``env_id`` (a module's name, ``-`` read as ``_``, or an Environments Hub
    id ``owner/name``) made by its ``load_environment(**args)``, once per process; any failure a
    ConfigError naming ``key``."""
    try:
        import verifiers
    except ImportError as error:
        raise ConfigError(f"{key}: verifiers:{env_id} needs the verifiers package ({error}): make installs it, or "
                          "pip install 'tether[verifiers]' and then pip install --no-deps verifiers==0.3.1") from None
    try:
        environment = _load(env_id, json.dumps(args or {}, sort_keys=True))
    except Exception as error:  # not importable, no load_environment, its own error
        raise ConfigError(f"{key}: verifiers could not load the environment {env_id!r}: {type(error).__name__}: "
                          f"{error}") from None
    if not isinstance(environment, verifiers.Environment):
        raise ConfigError(f"{key}: {env_id}'s load_environment returned a {type(environment).__name__}, not a "
                          "verifiers Environment")
    return environment


@functools.cache
def _load(env_id: str, args: str):
    import datasets
    import verifiers

    datasets.disable_progress_bar()  # its dataset's formatting would draw bars on the rollout's log
    return verifiers.load_environment(env_id, **json.loads(args))


def dataset_rows(spec: str, args: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """The dataset of ``spec`` (``verifiers:<id>``, or ``verifiers:<id>#eval`` for its eval
    dataset) as tether's prompt rows: each row's fields, its chat prompt as ``messages`` (a text
    prompt stays ``prompt``)."""
    env_id = environment_id(spec)
    environment = load(env_id, args, key)
    try:
        if spec.endswith(EVAL):
            if environment.build_eval_dataset() is None:  # verifiers would give its training set instead
                raise ConfigError(f"{key}: verifiers:{env_id} gives no eval dataset (held-out prompts); name a file "
                                  "of them instead")
            dataset = environment.get_eval_dataset()
        else:
            dataset = environment.get_dataset()
    except ConfigError:
        raise
    except Exception as error:  # its dataset's own failure
        raise ConfigError(f"{key}: verifiers:{env_id}'s dataset: {type(error).__name__}: {error}") from None
    rows = []
    for record in dataset:
        row = dict(record)
        if isinstance(row.get("prompt"), list):
            row["messages"] = row.pop("prompt")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{key}: verifiers:{env_id}'s dataset holds no row")
    return rows


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
    ``openai.AsyncOpenAI`` of the episode's key); its reward and metrics, the agent program's return."""
    import verifiers

    output = await environment.run_rollout(rollout_input(environment, row),
                                           verifiers.OpenAIChatCompletionsClient(client), MODEL, {})
    if output.get("error"):
        raise RuntimeError(f"the verifiers rollout failed: {output['error']}")
    metrics = {name: float(value) for name, value in (output.get("metrics") or {}).items()
               if isinstance(value, (int, float)) and not isinstance(value, bool)}
    return {**metrics, "reward": float(output["reward"])}


def program(env_id: str, args: dict[str, Any] | None):
    """The agent program (``run(client, row)``, async) of ``verifiers:<env_id>``'s episodes."""
    return functools.partial(play, load(env_id, args))
