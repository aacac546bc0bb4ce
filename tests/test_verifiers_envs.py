"""verifiers environments as tether's episodes (common/verifiers_envs.py): their datasets as the
run's prompt rows, rows given to them as their own datasets give them, and the errors that name
the key. Their episodes on a real engine, token for token against the native ones:
tests/test_agent_demo.py; the README's, played by hand: tests/test_readme_examples.py."""

import pytest

from common.config import ConfigError


def test_the_environments_dataset_is_the_runs_prompts_and_its_rows_go_back_as_they_came():
    from common import verifiers_envs
    from common.prompts import read_rows

    rows = read_rows("verifiers:demos.agent_verifiers")
    assert rows == [{"question": "add 1 2 3 + 4 5 6 :", "answer": "579", "example_id": 0,
                     "messages": [{"role": "user", "content": "add 1 2 3 + 4 5 6 :"}]},
                    {"question": "add 9 0 0 + 1 0 0 :", "answer": "1000", "example_id": 1,
                     "messages": [{"role": "user", "content": "add 9 0 0 + 1 0 0 :"}]}]
    environment = verifiers_envs.load("demos.agent_verifiers")
    assert environment is verifiers_envs.load("demos.agent_verifiers", {})  # once per process
    dataset_row = dict(environment.get_dataset()[1])
    assert verifiers_envs.rollout_input(environment, rows[1]) == dataset_row
    # a row of a file: its text the user's question, after the environment's system prompt
    environment.system_prompt = "Add."
    try:
        assert verifiers_envs.rollout_input(environment, {"prompt": "add 1 + 2 :", "answer": "3"}) == {
            "prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "add 1 + 2 :"}],
            "answer": "3", "example_id": 0}
        assert verifiers_envs.rollout_input(environment, rows[0])["prompt"][0] == {"role": "system", "content": "Add."}
    finally:
        environment.system_prompt = None


def test_what_cannot_be_loaded_is_named_with_its_key(tmp_path):
    from common import verifiers_envs
    from common.config import load_config
    from common.prompts import read_rows
    from tests.helpers import base_config

    with pytest.raises(ConfigError, match=r"rollout.environment: verifiers could not load the environment "
                                          r"'no_such_environment': ValueError: Could not import"):
        verifiers_envs.load("no_such_environment")
    with pytest.raises(ConfigError, match=r"data.prompts: .*unexpected keyword argument 'rows'"):
        read_rows("verifiers:demos.agent_verifiers", environment_args={"rows": 3})
    with pytest.raises(ConfigError, match=r"eval.prompts: verifiers:demos.agent_verifiers gives no eval dataset"):
        read_rows("verifiers:demos.agent_verifiers#eval", "eval.prompts")
    with pytest.raises(ConfigError, match=r"returned a SimpleNamespace, not a verifiers Environment"):
        verifiers_envs.load("tests.test_verifiers_envs")
    base = base_config(tmp_path, {"policy": "/p", "reward": "/r", "prompts": "/q"})
    with pytest.raises(ConfigError, match="rollout.environment_args are a verifiers environment's"):
        load_config(None, ['rollout.environment_args={"tools": false}'], base=base)
    with pytest.raises(ConfigError, match="rollout.tools: a verifiers environment brings its own tools"):
        load_config(None, ["rollout.environment=verifiers:demos.agent_verifiers", "rollout.tools=[m:f]"], base=base)


def load_environment():
    """Not an environment (what verifiers itself reads of one alone): the test above sees it refused."""
    import types

    return types.SimpleNamespace(env_id="", env_args={})
