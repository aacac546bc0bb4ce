"""What a role would find wrong with the run's data and user code only after ``tether run`` started
every process (a prompt file's bad line, read by the rollout seconds later, exit 1 while the other
roles wait): checked once before any process starts, each error naming the config key, the file
and the line. The roles check again as they read (``tether launch ROLE`` alone starts no runner).

What needs a model's tokenizer (a chat the template refuses, prompts longer than
``rollout.max_model_len``) stays with the roles: loading transformers here would cost every start
seconds.
"""

from __future__ import annotations

import os
import shutil

from common.config import ConfigError, TetherConfig


def check_run_data(config: TetherConfig) -> None:
    """The files and functions PPO reads: data.prompts, eval.prompts, data.ptx, scorer.reward_functions
    and gold_reward, the judges' templates (against the rows), rollout.tools, rollout.environment and
    the agent program. Raises ``ConfigError`` at the first problem."""
    from common import verifiers_data
    from common.functions import load_function
    from common.prompts import read_rows, read_texts
    from environments.native import Environments
    from environments.tools import load_tools
    from scorer.judges import check_template
    from scorer.rewards import RewardFunction

    rows = read_rows(config.data.prompts, environment_args=config.rollout.environment_args)
    if config.eval.prompts:
        read_rows(config.eval.prompts, "eval.prompts", config.rollout.environment_args)
    if config.data.ptx:
        read_texts(config.data.ptx)
    for i, function in enumerate(config.scorer.reward_functions):
        RewardFunction.load(function.function, function.weight, f"scorer.reward_functions[{i}].function")
    if config.scorer.gold_reward:
        RewardFunction.load(config.scorer.gold_reward, 1.0, "scorer.gold_reward")
    for i, judge in enumerate(config.scorer.judges):
        check_template(judge, f"scorer.judges[{i}]", rows)
    env_id = verifiers_data.environment_id(config.rollout.environment)
    if env_id is not None:
        verifiers_data.load(env_id, config.rollout.environment_args)
    else:
        Environments.load(config.rollout.environment, load_tools(config.rollout.tools, schemas=False))
    if config.rollout.agent:
        load_function(config.rollout.agent, "rollout.agent")
    if config.rollout.agent_command and shutil.which(config.rollout.agent_command[0]) is None:
        raise ConfigError(f"rollout.agent_command: {config.rollout.agent_command[0]!r} is not a program on this "
                          "machine's PATH, nor a path to one")


def check_stage_data(config: TetherConfig) -> None:
    """Each stage's rows (``sft.data``, ``rm.eval_data``, ...) have its form, for ``tether pipeline``,
    where the reward model's data would otherwise be read only after SFT trained."""
    from common.prompts import read_records
    from stages.examples import FORMS, STAGE_FORMS

    for name, form in STAGE_FORMS.items():
        section = getattr(config, name)
        if section is None:
            continue
        for key in ("data", "eval_data"):
            if getattr(section, key):
                read_records(getattr(section, key), f"{name}.{key}", *FORMS[form])


def check_placement(config: TetherConfig, available: set[int] | None = None) -> None:
    """``placement.cores`` on this host: each role's list names cores this process may run on
    (``available``; default its affinity, which a container or ``taskset`` narrows). A core past
    them made the role's start fail inside the child (os.sched_setaffinity: "Invalid argument")
    after the others had started; an empty list read as "every core". Raises ``ConfigError``."""
    available = set(os.sched_getaffinity(0)) if available is None else available
    for role, cores in config.placement.cores.items():
        if not cores:
            raise ConfigError(f"placement.cores.{role}: an empty list; name the role's cores, or leave the role "
                              "out to run it on every core")
        outside = sorted(set(cores) - available)
        if outside:
            raise ConfigError(f"placement.cores.{role}: core{'s' if len(outside) > 1 else ''} "
                              f"{', '.join(map(str, outside))} {'are' if len(outside) > 1 else 'is'} not among the "
                              f"cores this machine gives tether ({_ranges(sorted(available))})")


def _ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for core in cores:
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ", ".join(f"{low}-{high}" if high > low else str(low) for low, high in spans)
