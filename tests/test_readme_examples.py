"""The README's examples as a user runs them: the files it gives (``# my_env.py`` as a block's first
line names the file) written into a directory of their own, and the installed `tether` command
run from there, so the documentation cannot drift from the code."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from common.runlog import read_metrics
from launch.exit_codes import ExitCode
from tests.helpers import REPO, TWO_CORES

FILE_BLOCK = re.compile(r"```(?:python|yaml)\n# ([\w.]+\.(?:py|yaml))\n(.*?)```", re.S)
# the run made small for two cores; the README's own keys (environment, tools, reward) stay its own
SMALL = ["learner.total_steps=2", "learner.batch_size=8", "learner.minibatch_size=4", "rollout.max_new_tokens=6",
         "rollout.max_model_len=64", "rollout.kv_cache_gib=0.1", "rollout.prompts_per_generate=8",
         "transport.connect_retries=60", "transport.connect_interval_s=0.5",
         *(f"placement.cores.{role}={cores}" for role, cores in TWO_CORES["cores"].items())]


def readme_files() -> dict[str, str]:
    """Every file the README gives whole, by name; one given twice must be given the same."""
    with open(os.path.join(REPO, "README.md")) as file:
        text = file.read()
    files: dict[str, str] = {}
    for name, body in FILE_BLOCK.findall(text):
        content = f"# {name}\n{body}"
        assert files.setdefault(name, content) == content, f"the README gives {name} twice, differently"
        files[name] = content
    return files


def test_the_readme_gives_its_episode_example_whole():
    files = readme_files()
    assert {"my.yaml", "my_env.py", "my_tools.py", "my_rewards.py"} <= set(files)
    assert "my_env:make" in files["my.yaml"] and "my_tools:add" in files["my.yaml"]


def test_the_readme_agent_is_answered_through_the_endpoint_and_its_config_holds(tmp_path, monkeypatch):
    """The README's my_agent.py (with its my_tools.py) as the rollout runs it, the policy's turns
    given by hand: its call's messages are the first observation, its tool's result the next, its
    return the reward; its config keys are tether's."""
    import yaml

    from common.config import load_config
    from rollout.agents import AgentPrograms
    from rollout.environments import Step
    from rollout.tools import ToolCallParser
    from tests.helpers import base_config, chatml_tokenizer

    files = readme_files()
    for name in ("my_agent.py", "my_tools.py"):
        (tmp_path / name).write_text(files[name])
    monkeypatch.syspath_prepend(str(tmp_path))
    with open(os.path.join(REPO, "README.md")) as file:
        block = next(b for b in re.findall(r"```yaml\n(.*?)```", file.read(), re.S) if "my_agent:solve" in b)
    config = load_config(None, base={**base_config(tmp_path, {"policy": "/p", "reward": "/r", "prompts": "/q"}),
                                     **yaml.safe_load(block)})
    assert config.rollout.agent == "my_agent:solve" and config.rollout.tool_parser == "hermes"
    # in the process the config asks for, as the rollout runs it
    programs = AgentPrograms("my_agent:solve", ToolCallParser("hermes", chatml_tokenizer(str(tmp_path / "tokenizer")),
                                                              None), 30.0, 30.0,
                             processes=config.rollout.agent_processes, cores=config.placement.cores.get("agent"))
    try:
        episode = programs.make({"prompt": "What is 17 plus 25?", "answer": "42"})
        assert episode.reset() == [{"role": "user", "content": "What is 17 plus 25?"}]
        step = episode.step('<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>', [])
        assert [(m["role"], m["content"]) for m in step.observation] == [("tool", "42")]
        assert episode.step("The answer is 42", []) == Step(None, 1.0, done=True)
    finally:
        programs.close()


def test_the_readme_command_agent_runs_in_a_process_of_its_own(tmp_path):
    """The README's my_command_agent.py as rollout.agent_command starts it: its call is the first
    observation, what it prints last its reward."""
    from rollout.agents import AgentPrograms
    from rollout.environments import Step
    from rollout.tools import ToolCallParser
    from tests.helpers import chatml_tokenizer

    script = tmp_path / "my_command_agent.py"
    script.write_text(readme_files()["my_command_agent.py"])
    programs = AgentPrograms([sys.executable, str(script)], ToolCallParser(
        "hermes", chatml_tokenizer(str(tmp_path / "tokenizer")), None), 30.0, 30.0)
    try:
        episode = programs.make({"prompt": "What is 17 plus 25?", "answer": "42"})
        assert episode.reset() == [{"role": "user", "content": "What is 17 plus 25?"}]
        assert episode.step("The answer is 42", []) == Step(None, 1.0, done=True)
    finally:
        programs.close()


def test_the_readme_openenv_server_is_played_through_tether(tmp_path):
    """The README's my_openenv_server.py started as a user starts it (a process of its own, its port
    in PORT) and my_openenv.yaml's environment pointed at it: each episode a session of its own, its
    reset given the row's ``reset``, the server's hints, rewards and ``done`` the turns'."""
    import urllib.request

    from common.config import load_config
    from protocol.transport import free_port
    from rollout.environments import Environments, Step

    files = readme_files()
    for name in ("my_openenv_server.py", "my_openenv.yaml"):
        (tmp_path / name).write_text(files[name])
    port = free_port()
    server = subprocess.Popen([sys.executable, "my_openenv_server.py"], cwd=tmp_path, env={**os.environ, "PORT": str(port)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60.0
        while True:
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1.0).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the README's OpenEnv server did not answer /health in 60 s"
                time.sleep(0.2)
        config = load_config(tmp_path / "my_openenv.yaml", [f"rollout.environment=openenv:{url}"])
        assert (config.rollout.max_turns, config.models.reward) == (4, None)
        environments = Environments.load(config.rollout.environment, {}, step_deadline_s=config.rollout.env_step_deadline_s)
        seven = environments.make({"prompt": "Guess my number, 0 to 9.", "reset": {"answer": 7}})
        three = environments.make({"prompt": "Guess my number, 0 to 9.", "reset": {"answer": 3}})
        assert seven.reset() == three.reset() == "Guess my number, 0 to 9."
        assert seven.step("5", []) == Step("higher", 0.0, False)
        assert three.step("5", []) == Step("lower", 0.0, False)  # a session of its own: its own answer
        assert seven.step("It is 7", []) == Step("right", 1.0, True)
        seven.close(), three.close()
    finally:
        server.kill()
        server.wait(timeout=10)


def test_the_readme_verifiers_environment_is_played_through_the_endpoint(tmp_path, monkeypatch):
    """The README's my_verifiers_env.py and my_verifiers.yaml as the rollout runs them, the
    policy's turns given by hand: the environment's dataset is the run's prompts, its system
    prompt and question the first observation, its answers the next, its rubric's score the
    reward, its metrics the episode's."""
    from common.config import load_config
    from common.prompts import read_rows
    from rollout.agents import agent_programs
    from tests.helpers import chatml_tokenizer

    files = readme_files()
    for name in ("my_verifiers_env.py", "my_verifiers.yaml"):
        (tmp_path / name).write_text(files[name])
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(tmp_path / "my_verifiers.yaml")
    rows = read_rows(config.data.prompts, environment_args=config.rollout.environment_args)
    assert len(rows) == 100 and rows[7]["answer"] == "7"
    programs = agent_programs(config, chatml_tokenizer(str(tmp_path / "tokenizer")))
    try:
        episode = programs.make(rows[7])
        assert episode.reset() == [{"role": "system", "content": "Answer with one digit."},
                                   {"role": "user", "content": "Guess my number, 0 to 9."}]
        assert [(m["role"], m["content"]) for m in episode.step("5", []).observation] == [("user", "higher")]
        step = episode.step("7", [])
        assert (step.observation, step.reward, step.done) == (None, 1.0, True)
        assert step.metrics == {"right": 1.0, "num_turns": 2.0}
        missed = programs.make({"prompt": "Guess my number, 0 to 9.", "answer": "3"})  # a row of a file
        assert missed.reset()[0] == {"role": "system", "content": "Answer with one digit."}
        for guess in "0000":
            step = missed.step(guess, [])
        assert (step.observation, step.reward, step.done) == (None, 0.0, True)
    finally:
        programs.close()


def tether_from(directory, *args) -> subprocess.CompletedProcess:
    """The installed `tether` command (its own script, not ``python -m``: the script's path holds
    only its bin directory), in ``directory``, with no PYTHONPATH of the caller's."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    command = os.path.join(os.path.dirname(sys.executable), "tether")
    return subprocess.run([command, *args], cwd=directory, capture_output=True, text=True, timeout=400,
                          env=environment)


@pytest.mark.slow
def test_the_readme_episode_example_trains_from_its_own_directory_and_a_broken_environment_ends_the_run(
        tmp_path, tiny_assets):
    """The README's my.yaml, my_env.py, my_tools.py and my_rewards.py, run as they are from their
    directory (no reward model: the environment's turn rewards and the reward function), train;
    then the same run with an environment whose every reset raises ends with the reason, exit
    code 4 from the rollout, not restarted, a short log and the learner's checkpoint."""
    mine = tmp_path / "mine"
    mine.mkdir()
    for name, content in readme_files().items():
        (mine / name).write_text(content)
    with open(tiny_assets["prompts"]) as file:
        prompts = [json.loads(line)["prompt"] for line in file][:64]
    (mine / "guess.jsonl").write_text("".join(json.dumps({"prompt": prompt, "answer": str(i % 10)}) + "\n"
                                              for i, prompt in enumerate(prompts)))
    overrides = [item for o in [f"models.policy={tiny_assets['policy']}", *SMALL] for item in ("-o", o)]
    result = tether_from(mine, "run", "-c", "my.yaml", *overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = str(mine / "runs" / "guess")
    assert [r["step"] for r in read_metrics(run_dir, "learner")] == [1, 2]
    rollout = read_metrics(run_dir, "rollout0")
    assert sum(r.get("episodes", 0) for r in rollout) >= 16  # two batches of episodes
    assert sum(r.get("episodes_ended_done", 0) + r.get("episodes_ended_max_turns", 0) for r in rollout) > 0
    assert any("my_rewards:exact_answer" in r for r in read_metrics(run_dir, "scorer0"))
    # the rollout's last period is in its metrics (it was lost at shutdown): they add up to its log's total
    generated = rollout[-1]["generated_total"]
    assert sum(r["samples"] for r in rollout) == generated
    assert f"stopping after {generated} samples" in (mine / "runs" / "guess" / "logs" / "rollout0.log").read_text()

    # the evaluation of an environment's task counts the environment's rewards, beside the scorer's
    evaluated = tether_from(mine, "eval", os.path.join(run_dir, "checkpoints", "final"), "-c", "my.yaml", *overrides,
                            "-o", "eval.prompts=guess.jsonl", "-o", "eval.max_prompts=16", "--step", "2")
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    figures, = read_metrics(run_dir, "eval")
    assert {"env_reward", "env_reward_per_turn", "scorer_reward"} <= set(figures), figures
    assert figures["reward"] == pytest.approx(figures["scorer_reward"] + figures["env_reward"])

    (mine / "broken_env.py").write_text("def make(row):\n    raise RuntimeError('no sandbox to be had')\n")
    broken = tether_from(mine, "run", "-c", "my.yaml", *overrides, "-o", "rollout.environment=broken_env:make",
                         "-o", "rollout.env_failure_limit=20", "-o", "run_dir=runs/broken")
    assert broken.returncode == ExitCode.FAILED, broken.stdout[-3000:] + broken.stderr[-3000:]
    assert "rollout0 exited with code 4: the environment failed every episode" in broken.stderr, broken.stderr[-3000:]
    assert "restarting" not in broken.stderr
    # the learner, asked first, checkpointed through the buffer still there: the fixed environment resumes
    assert "asking learner to checkpoint and stop" in broken.stderr
    assert os.listdir(mine / "runs" / "broken" / "checkpoints") == ["state-000000"]
    log = (mine / "runs" / "broken" / "logs" / "rollout0.log").read_text()
    assert "20 episodes in a row ended by their environment" in log
    assert log.count("(logged once") == 1 and log.count("Traceback") == 1, log[-3000:]
    assert "no sandbox to be had" in log
    assert len(log) < 100_000
