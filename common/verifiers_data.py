"""verifiers environments' loading and datasets, which every process that reads prompt rows shares
(the rollout, the scorer for reward functions, ``tether eval``): ``data.prompts: verifiers:<id>``
is the environment's own dataset (``verifiers:<id>#eval`` its eval dataset), and
``rollout.environment_args`` are its ``load_environment``'s keywords. Its episodes are the
rollout's (``environments.verifiers_envs``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import signal
from typing import Any

from common.config import ConfigError

PREFIX = "verifiers:"
EVAL = "#eval"  # data.prompts or eval.prompts verifiers:<id>#eval: the environment's eval dataset


def environment_id(spec: str | None) -> str | None:
    """The id in ``verifiers:<id>`` (or ``verifiers:<id>#eval``), or None for any other spec."""
    return spec.removeprefix(PREFIX).removesuffix(EVAL) if spec and spec.startswith(PREFIX) else None


def load(env_id: str, args: dict[str, Any] | None = None, key: str = "rollout.environment"):
    """The environment ``env_id`` (a module's name, ``-`` read as ``_``, or an Environments Hub
    id ``owner/name``) made by its ``load_environment(**args)``, once per process; any failure a
    ConfigError naming ``key``."""
    if importlib.util.find_spec("verifiers") is None:  # its absence said plainly, before the environment is looked for
        raise ConfigError(f"{key}: verifiers:{env_id} needs the verifiers package: make installs it, or "
                          "pip install 'tether[verifiers]' and then pip install --no-deps verifiers==0.3.1")
    try:
        environment = _load(env_id, json.dumps(args or {}, sort_keys=True))
    except Exception as error:  # not importable, no load_environment, its own error
        raise ConfigError(f"{key}: verifiers could not load the environment {env_id!r}: {type(error).__name__}: "
                          f"{error}") from None
    return environment


@functools.cache
def _load(env_id: str, args: str):
    import datasets
    import verifiers

    datasets.disable_progress_bar()  # its dataset's formatting would draw bars on the rollout's log
    # an Environment sets SIGINT and SIGTERM handlers of its own as it is made (SIGTERM: exit 143):
    # the process's own (a role's orderly stop) stay
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        environment = verifiers.load_environment(env_id, **json.loads(args))
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    if not isinstance(environment, verifiers.Environment):
        raise TypeError(f"its load_environment returned a {type(environment).__name__}, not a verifiers Environment")
    _check_rubric(environment)
    return environment


def _check_rubric(environment) -> None:
    """An episode is scored alone, as it ends (``Rubric.score_rollout``, which asserts both): a
    rubric that scores groups of rollouts, or one with no reward function, is refused at load."""
    rubrics, leaves = [environment.rubric], []
    while rubrics:
        rubric = rubrics.pop()
        if getattr(rubric, "rubrics", None) is not None:  # a RubricGroup: what it sums
            rubrics.extend(rubric.rubrics)
        else:
            leaves.append(rubric)
    for rubric in leaves:
        if rubric.has_group_rewards:
            raise ValueError(f"its {type(rubric).__name__} scores groups of rollouts (a function of completions, "
                             "states, ...): tether scores each episode as it ends")
        if not rubric.funcs:
            raise ValueError(f"its {type(rubric).__name__} has no reward function: give its rubric one")


def dataset_rows(spec: str, args: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """The dataset of ``spec`` (``verifiers:<id>``, or ``verifiers:<id>#eval`` for its eval
    dataset) as tether's prompt rows: each row's fields, its chat prompt as ``messages`` (a text
    prompt stays ``prompt``); ``common.prompts.read_rows`` checks them."""
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
    return rows
