"""verifiers environments as tether's episodes (common/verifiers_data.py, environments/verifiers_envs.py): their datasets as the
run's prompt rows, rows given to them as their own datasets give them, and the errors that name
the key. Their episodes on a real engine, token for token against the native ones:
tests/test_agent_demo.py; the docs', played by hand: tests/test_readme_examples.py."""

import pytest

from common.config import ConfigError


def test_the_environments_dataset_is_the_runs_prompts_and_its_rows_go_back_as_they_came():
    from common import verifiers_data
    from environments import verifiers_envs
    from common.prompts import read_rows

    rows = read_rows("verifiers:demos.agent_verifiers")
    assert rows == [{"question": "add 1 2 3 + 4 5 6 :", "answer": "579", "example_id": 0,
                     "messages": [{"role": "user", "content": "add 1 2 3 + 4 5 6 :"}]},
                    {"question": "add 9 0 0 + 1 0 0 :", "answer": "1000", "example_id": 1,
                     "messages": [{"role": "user", "content": "add 9 0 0 + 1 0 0 :"}]}]
    environment = verifiers_data.load("demos.agent_verifiers")
    assert environment is verifiers_data.load("demos.agent_verifiers", {})  # once per process
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
    from common import verifiers_data
    from environments import verifiers_envs
    from common.config import load_config
    from common.prompts import read_rows
    from tests.helpers import base_config

    with pytest.raises(ConfigError, match=r"rollout.environment: verifiers could not load the environment "
                                          r"'no_such_environment': ValueError: Could not import"):
        verifiers_data.load("no_such_environment")
    with pytest.raises(ConfigError, match=r"data.prompts: .*unexpected keyword argument 'rows'"):
        read_rows("verifiers:demos.agent_verifiers", environment_args={"rows": 3})
    with pytest.raises(ConfigError, match=r"eval.prompts: verifiers:demos.agent_verifiers gives no eval dataset"):
        read_rows("verifiers:demos.agent_verifiers#eval", "eval.prompts")
    with pytest.raises(ConfigError, match=r"TypeError: its load_environment returned a SimpleNamespace, not a "
                                          r"verifiers Environment"):
        verifiers_data.load("tests.test_verifiers_envs", {"kind": "not an environment"})
    with pytest.raises(ConfigError, match=r"its Rubric scores groups of rollouts .*: tether scores each episode"):
        verifiers_data.load("tests.test_verifiers_envs", {"kind": "group rubric"})
    with pytest.raises(ConfigError, match=r"its Rubric has no reward function"):
        verifiers_data.load("tests.test_verifiers_envs", {"kind": "no rubric"})
    base = base_config(tmp_path, {"policy": "/p", "reward": "/r", "prompts": "/q"})
    with pytest.raises(ConfigError, match="rollout.environment_args are a verifiers environment's"):
        load_config(None, ['rollout.environment_args={"tools": false}'], base=base)
    with pytest.raises(ConfigError, match="rollout.tools: a verifiers environment brings its own tools"):
        load_config(None, ["rollout.environment=verifiers:demos.agent_verifiers", "rollout.tools=[m:f]"], base=base)


def test_episodes_from_threads_of_their_own_run_in_one_loop_and_keep_the_processs_signal_handlers():
    """Program threads each await their episode in a loop of their own; verifiers' rollouts, and
    what the environment made once, run in the one loop of verifiers' episodes (here: a rubric
    that holds a lock bound to the loop it first ran in). Loading the environment leaves this
    process's SIGTERM handler as it was. The eval dataset is the rows of ``#eval``. (The model is a
    stand-in answering over httpx: the real engine's episodes are tests/test_agent_demo.py's.)"""
    import asyncio
    import signal
    import threading

    import httpx
    from openai import AsyncOpenAI

    from common import verifiers_data
    from environments import verifiers_envs
    from common.prompts import read_rows

    def handler(number, frame):
        pass

    before = signal.signal(signal.SIGTERM, handler)
    try:
        environment = verifiers_data.load("tests.test_verifiers_envs", {"kind": "loops"})
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, before)
    assert [row["answer"] for row in read_rows("verifiers:tests.test_verifiers_envs#eval", "eval.prompts",
                                               {"kind": "loops"})] == ["held out"]

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"id": "x", "object": "chat.completion", "created": 1, "model": "policy",
                                         "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                             "role": "assistant", "content": "4"}}]})

    results = {}

    def episode(name: str, row: dict) -> None:
        client = AsyncOpenAI(base_url="http://endpoint/v1", api_key="k", max_retries=0,
                             http_client=httpx.AsyncClient(transport=httpx.MockTransport(answer)))
        try:
            results[name] = asyncio.run(verifiers_envs.play(environment, client, row))
        except Exception as error:  # the assertion below shows it
            results[name] = error

    threads = [threading.Thread(target=episode, args=(name, {"prompt": "2+2?", "answer": answer}), daemon=True)
               for name, answer in (("right", "4"), ("wrong", "5"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == {"right": {"exact": 1.0, "num_turns": 1.0, "reward": 1.0},
                       "wrong": {"exact": 0.0, "num_turns": 1.0, "reward": 0.0}}
    assert LOOPS == {id(verifiers_envs._episodes_loop())}


LOOPS: set[int] = set()


def load_environment(kind: str):
    """What the tests above load (``verifiers:tests.test_verifiers_envs``, by ``kind``)."""
    import asyncio
    import types

    import verifiers as vf
    from datasets import Dataset

    if kind == "not an environment":  # what verifiers itself reads of one, alone
        return types.SimpleNamespace(env_id="", env_args={})
    dataset = Dataset.from_list([{"question": "2+2?", "answer": "4"}])

    async def exact(completion, answer, **_) -> float:
        return float(completion[-1]["content"] == answer)

    async def best_of_group(completions, answers, **_) -> list[float]:
        return [0.0 for _ in completions]

    if kind == "group rubric":
        return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[exact, best_of_group]))
    if kind == "no rubric":
        return vf.SingleTurnEnv(dataset=dataset)
    lock = asyncio.Lock()  # bound to the first loop that waits on it

    async def exact_under_lock(completion, answer, **_) -> float:
        LOOPS.add(id(asyncio.get_running_loop()))
        async with lock:
            await asyncio.sleep(0.05)
            return await exact(completion, answer)

    exact_under_lock.__name__ = "exact"
    held_out = Dataset.from_list([{"question": "3+3?", "answer": "held out"}])
    return vf.SingleTurnEnv(dataset=dataset, eval_dataset=held_out, rubric=vf.Rubric(funcs=[exact_under_lock]))
