"""The examples of the README and docs/ (its guides) as a user runs them: the files they give
(``# my_env.py`` as a block's first line names the file) written into a directory of their own, and
the installed `tether` command run from there, so the documentation cannot drift from the code."""

import contextlib
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from common.runlog import read_metrics
from launch.exit_codes import ExitCode
from tests.helpers import CHAT_TEMPLATE_WITH_SYSTEM, REPO, TWO_CORES, first_of, step_of

FILE_BLOCK = re.compile(r"```(?:python|yaml)\n# ([\w.]+\.(?:py|yaml))\n(.*?)```", re.S)
YAML_BLOCK = re.compile(r"^( *)```ya?ml\n(.*?)^\1```", re.S | re.M)  # a list item's block is indented
DOCS = [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))]
# the run made small for two cores; the docs' own keys (environment, tools, reward) stay their own
SMALL = ["learner.total_steps=2", "learner.batch_size=8", "learner.minibatch_size=4", "rollout.max_new_tokens=6",
         "rollout.max_model_len=64", "rollout.kv_cache_gib=0.1", "rollout.prompts_per_generate=8",
         "transport.connect_retries=60", "transport.connect_interval_s=0.5",
         *(f"placement.cores.{role}={cores}" for role, cores in TWO_CORES["cores"].items())]
# SMALL down to one step of the least that makes one (a later override wins): what a config of the
# docs must reach to be shown to run
ONE_STEP = [*SMALL, "learner.total_steps=1", "learner.batch_size=4", "learner.minibatch_size=4",
            "learner.ppo_epochs=1", "rollout.prompts_per_generate=4"]


def doc_files() -> dict[str, str]:
    """Every file the README and docs/ give whole, by name; one given twice (in one doc or in two)
    must be given the same."""
    files: dict[str, str] = {}
    given: dict[str, str] = {}  # name: the doc that gave it first
    for path in DOCS:
        with open(path) as file:
            text = file.read()
        doc = os.path.relpath(path, REPO)
        for name, body in FILE_BLOCK.findall(text):
            content = f"# {name}\n{body}"
            first = given.setdefault(name, doc)
            assert files.setdefault(name, content) == content, \
                f"{name} is given twice, differently: in {first} and in {doc}"
    return files


def doc_configs() -> dict[str, tuple[str, dict]]:
    """Every YAML block of the README and docs/ (its text, parsed) by its name: the file it gives
    (``# my.yaml`` first), else where it stands (``docs/operations.md:64``)."""
    configs = {}
    for path in DOCS:
        with open(path) as file:
            text = file.read()
        for block in YAML_BLOCK.finditer(text):
            indent = len(block.group(1))
            body = "".join(line[indent:] for line in block.group(2).splitlines(keepends=True))
            first = body.split("\n", 1)[0]
            named = re.fullmatch(r"# ([\w.]+\.ya?ml)", first)
            line = text.count("\n", 0, block.start()) + 1
            name = named.group(1) if named else f"{os.path.relpath(path, REPO)}:{line}"
            configs[name] = (body, yaml.safe_load(body))
    return configs


def runnable(config: dict) -> bool:
    """A whole config `tether run` takes as it is: PPO's models and prompts. The other blocks are parts
    of one (a section's keys) or `tether pipeline`'s stages."""
    return isinstance(config.get("models"), dict) and "policy" in config["models"] and isinstance(
        config.get("data"), dict) and "prompts" in config["data"]


RUNNABLE = sorted(name for name, (_, config) in doc_configs().items() if runnable(config))


def test_every_config_of_the_readme_and_docs_holds_tethers_keys():
    """Each YAML block validates: a whole config as it is, a part of one over a minimal config (its
    sections' keys added to the minimal ones). The whole ones are also run (the slow test below)."""
    from common.config import STAGES, load_config

    base = {"models": {"policy": "/p", "reward": "/r"}, "data": {"prompts": "/d.jsonl"}}
    assert {"my.yaml", "my_openenv.yaml", "my_verifiers.yaml"} <= set(RUNNABLE)
    for name, (_, config) in doc_configs().items():
        if not (runnable(config) or any(stage in config for stage in STAGES)):
            config = {**base, **{key: {**base[key], **value} if key in base else value for key, value in config.items()}}
        assert load_config(None, base=config), name


def test_the_readme_verifiers_config_passes_tether_runs_checks(tmp_path, monkeypatch):
    """`tether run -c my_verifiers.yaml` in its directory gets past every check made before a process
    starts: its data.prompts verifiers:<id> is the environment's dataset, not a file to be found
    (issue 52: "does not exist", exit 2). The roles' start is stubbed: the slow test below runs it."""
    from typer.testing import CliRunner

    import launch.runner
    from launch.cli import app

    files = doc_files()
    for name in ("my_verifiers_env.py", "my_verifiers.yaml"):
        (tmp_path / name).write_text(files[name])
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text('{"max_position_embeddings": 64}')
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # the command adds its directory
    started = []
    monkeypatch.setattr(launch.runner, "run_roles", lambda config, *_, **__: started.append(config) or 0)
    result = CliRunner().invoke(app, ["run", "-c", "my_verifiers.yaml", "-o", f"models.policy={policy}",
                                      "-o", "rollout.max_model_len=64"])
    assert result.exit_code == 0, result.output
    assert [config.data.prompts for config in started] == ["verifiers:my_verifiers_env"]


def test_the_readme_gives_its_episode_example_whole():
    files = doc_files()
    assert {"my.yaml", "my_env.py", "my_tools.py", "my_rewards.py"} <= set(files)
    assert "my_env:make" in files["my.yaml"] and "my_tools:add" in files["my.yaml"]


def test_the_readme_agent_is_answered_through_the_endpoint_and_its_config_holds(tmp_path, monkeypatch):
    """The docs' my_agent.py (with its my_tools.py) as the rollout runs it, the policy's turns
    given by hand: its call's messages are the first observation, its tool's result the next, its
    return the reward; its config keys are tether's."""
    import yaml

    from common.config import load_config
    from environments.agents import AgentPrograms
    from environments.interface import Step
    from environments.tools import ToolCallParser
    from tests.helpers import base_config, chatml_tokenizer

    files = doc_files()
    for name in ("my_agent.py", "my_tools.py"):
        (tmp_path / name).write_text(files[name])
    monkeypatch.syspath_prepend(str(tmp_path))
    block = next(body for body, _ in doc_configs().values() if "my_agent:solve" in body)
    config = load_config(None, base={**base_config(tmp_path, {"policy": "/p", "reward": "/r", "prompts": "/q"}),
                                     **yaml.safe_load(block)})
    assert config.rollout.agent == "my_agent:solve" and config.rollout.tool_parser == "hermes"
    # in the process the config asks for, as the rollout runs it
    programs = AgentPrograms("my_agent:solve", ToolCallParser("hermes", chatml_tokenizer(str(tmp_path / "tokenizer")),
                                                              None), 30.0, 30.0,
                             processes=config.rollout.agent_processes, cores=config.placement.cores.get("agent"))
    try:
        episode = programs.make({"prompt": "What is 17 plus 25?", "answer": "42"})
        assert first_of(episode) == [{"role": "user", "content": "What is 17 plus 25?"}]
        step = step_of(episode, '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>', [])
        assert [(m["role"], m["content"]) for m in step.observation] == [("tool", "42")]
        assert step_of(episode, "The answer is 42", []) == Step(None, 1.0, done=True)
    finally:
        programs.close()


@pytest.mark.parametrize("name", ["my_sdk_agent.py", "my_claude_agent.py"])
def test_the_docs_framework_agents_are_answered_through_the_endpoint(tmp_path, monkeypatch, name):
    """docs/guides/agent-frameworks.md's agents (the OpenAI Agents SDK over the Responses API,
    Anthropic's SDK over the Messages API) as the rollout runs them, the policy's turns given by
    hand: their first call is the first observation, the tool's result the next, the answer's
    check the reward."""
    from environments.agents import AgentPrograms
    from environments.interface import Step
    from environments.tools import ToolCallParser
    from tests.helpers import chatml_tokenizer

    files = doc_files()
    for each in (name, "my_tools.py"):
        (tmp_path / each).write_text(files[each])
    monkeypatch.syspath_prepend(str(tmp_path))
    block = next(body for body, _ in doc_configs().values() if "my_sdk_agent:solve" in body)
    assert f"{name.removesuffix('.py')}:solve" in block
    programs = AgentPrograms(f"{name.removesuffix('.py')}:solve",
                             ToolCallParser("hermes", chatml_tokenizer(str(tmp_path / "tokenizer")), None), 30.0, 30.0)
    try:
        episode = programs.make({"prompt": "What is 17 plus 25?", "answer": "42"})
        system = "Add with the tool." if name == "my_sdk_agent.py" else None
        assert first_of(episode) == [*([{"role": "system", "content": system}] if system else []),
                                     {"role": "user", "content": "What is 17 plus 25?"}]
        assert [tool["function"]["name"] for tool in episode.tools] == ["add"]
        step = step_of(episode, '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>', [])
        assert [(m["role"], m["content"]) for m in step.observation] == [("tool", "42")]
        assert step_of(episode, "The answer is 42", []) == Step(None, 1.0, done=True)
    finally:
        programs.close()


def test_the_readme_command_agent_runs_in_a_process_of_its_own(tmp_path):
    """The docs' my_command_agent.py as rollout.agent_command starts it: its call is the first
    observation, what it prints last its reward."""
    from environments.agents import AgentPrograms
    from environments.interface import Step
    from environments.tools import ToolCallParser
    from tests.helpers import chatml_tokenizer

    script = tmp_path / "my_command_agent.py"
    script.write_text(doc_files()["my_command_agent.py"])
    programs = AgentPrograms([sys.executable, str(script)], ToolCallParser(
        "hermes", chatml_tokenizer(str(tmp_path / "tokenizer")), None), 30.0, 30.0)
    try:
        episode = programs.make({"prompt": "What is 17 plus 25?", "answer": "42"})
        assert first_of(episode) == [{"role": "user", "content": "What is 17 plus 25?"}]
        assert step_of(episode, "The answer is 42", []) == Step(None, 1.0, done=True)
    finally:
        programs.close()


@contextlib.contextmanager
def docs_openenv_server(directory):
    """The docs' my_openenv_server.py, in ``directory``, started as a user starts it (a process of
    its own, its port in PORT); yields its URL once it answers /health."""
    import urllib.request

    from protocol.transport import free_port

    (directory / "my_openenv_server.py").write_text(doc_files()["my_openenv_server.py"])
    port = free_port()
    server = subprocess.Popen([sys.executable, "my_openenv_server.py"], cwd=directory,
                              env={**os.environ, "PORT": str(port)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60.0
        while True:
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1.0).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the docs' OpenEnv server did not answer /health in 60 s"
                time.sleep(0.2)
        yield url
    finally:
        server.kill()
        server.wait(timeout=10)


def test_the_readme_openenv_server_is_played_through_tether(tmp_path):
    """The docs' my_openenv_server.py started as a user starts it and my_openenv.yaml's
    environment pointed at it: each episode a session of its own, its reset given the row's
    ``reset``, the server's hints, rewards and ``done`` the turns'."""
    from common.config import load_config
    from environments.interface import Step
    from environments.native import Environments

    (tmp_path / "my_openenv.yaml").write_text(doc_files()["my_openenv.yaml"])
    with docs_openenv_server(tmp_path) as url:
        config = load_config(tmp_path / "my_openenv.yaml", [f"rollout.environment=openenv:{url}"])
        assert (config.rollout.max_turns, config.models.reward) == (4, None)
        environments = Environments.load(config.rollout.environment, {}, step_deadline_s=config.rollout.env_step_deadline_s)
        seven = environments.make({"prompt": "Guess my number, 0 to 9.", "reset": {"answer": 7}})
        three = environments.make({"prompt": "Guess my number, 0 to 9.", "reset": {"answer": 3}})
        assert first_of(seven) == first_of(three) == "Guess my number, 0 to 9."
        assert step_of(seven, "5", []) == Step("higher", 0.0, False)
        assert step_of(three, "5", []) == Step("lower", 0.0, False)  # a session of its own: its own answer
        assert step_of(seven, "It is 7", []) == Step("right", 1.0, True)
        seven.close(), three.close()


def test_the_readme_verifiers_environment_is_played_through_the_endpoint(tmp_path, monkeypatch):
    """The docs' my_verifiers_env.py and my_verifiers.yaml as the rollout runs them, the
    policy's turns given by hand: the environment's dataset is the run's prompts, its system
    prompt and question the first observation, its answers the next, its rubric's score the
    reward, its metrics the episode's."""
    from common.config import load_config
    from common.prompts import read_rows
    from environments.agents import agent_programs
    from tests.helpers import chatml_tokenizer

    files = doc_files()
    for name in ("my_verifiers_env.py", "my_verifiers.yaml"):
        (tmp_path / name).write_text(files[name])
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(tmp_path / "my_verifiers.yaml")
    rows = read_rows(config.data.prompts, environment_args=config.rollout.environment_args)
    assert len(rows) == 100 and rows[7]["answer"] == "7"
    programs = agent_programs(config, chatml_tokenizer(str(tmp_path / "tokenizer")))
    try:
        episode = programs.make(rows[7])
        assert first_of(episode) == [{"role": "system", "content": "Answer with one digit."},
                                   {"role": "user", "content": "Guess my number, 0 to 9."}]
        assert [(m["role"], m["content"]) for m in step_of(episode, "5", []).observation] == [("user", "higher")]
        step = step_of(episode, "7", [])
        assert (step.observation, step.reward, step.done) == (None, 1.0, True)
        assert step.metrics == {"right": 1.0, "num_turns": 2.0}
        missed = programs.make({"prompt": "Guess my number, 0 to 9.", "answer": "3"})  # a row of a file
        assert first_of(missed)[0] == {"role": "system", "content": "Answer with one digit."}
        for guess in "0000":
            step = step_of(missed, guess, [])
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
    """The docs' my.yaml, my_env.py, my_tools.py and my_rewards.py, run as they are from their
    directory (no reward model: the environment's turn rewards and the reward function), train;
    then the same run with an environment whose every reset raises ends with the reason, exit
    code 4 from the rollout, not restarted, a short log and the learner's checkpoint."""
    mine = tmp_path / "mine"
    mine.mkdir()
    for name, content in doc_files().items():
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
    assert broken.returncode == ExitCode.ENVIRONMENT_FAILED, broken.stdout[-3000:] + broken.stderr[-3000:]
    assert "rollout0 exited with code 4: the environment failed every episode" in broken.stderr, broken.stderr[-3000:]
    assert "restarting" not in broken.stderr
    # the learner, asked first, checkpointed through the buffer still there: the fixed environment resumes
    assert "asking learner to checkpoint and stop" in broken.stderr
    assert os.listdir(mine / "runs" / "broken" / "checkpoints") == ["state-000000"]
    # stopped by `tether run`, the buffer still wrote what the run did: the identity can be checked
    accounting = json.loads((mine / "runs" / "broken" / "metrics" / "buffer_accounting.json").read_text())
    assert accounting["ended_by"] == "SIGTERM" and accounting["identity_holds"], accounting
    log = (mine / "runs" / "broken" / "logs" / "rollout0.log").read_text()
    assert "20 episodes in a row ended by their environment" in log
    assert log.count("(logged once") == 1 and log.count("Traceback") == 1, log[-3000:]
    assert "no sandbox to be had" in log
    assert len(log) < 100_000


@pytest.fixture(scope="module")
def docs_directory(tmp_path_factory, tiny_assets):
    """One directory as a user of the docs has it, shared by their configs' runs: every file the
    docs give, the tiny policy (with a chat template, as a user's model has) and reward model,
    and each data file a config names (the tiny task's prompts, each row with an ``answer`` for the
    docs' environment and reward function and a ``reset`` for their OpenEnv server)."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("docs")
    for name, content in doc_files().items():
        (directory / name).write_text(content)
    shutil.copytree(tiny_assets["policy"], directory / "policy")
    tokenizer = AutoTokenizer.from_pretrained(directory / "policy")
    tokenizer.chat_template = CHAT_TEMPLATE_WITH_SYSTEM
    tokenizer.save_pretrained(directory / "policy")
    with open(tiny_assets["prompts"]) as file:
        prompts = [json.loads(line)["prompt"] for line in file][:64]
    rows = "".join(json.dumps({"prompt": prompt, "answer": str(i % 10), "reset": {"answer": i % 10}}) + "\n"
                   for i, prompt in enumerate(prompts))
    for name in RUNNABLE:
        for path in data_files(doc_configs()[name][1]).values():
            (directory / path).write_text(rows)
    return directory


def data_files(config: dict) -> dict[str, str]:
    """The prompt files a config reads, by key, each where the test writes it: in the run's directory
    (an absolute path's file name there); a verifiers environment's dataset is no file."""
    paths = {"data.prompts": config["data"]["prompts"], "eval.prompts": (config.get("eval") or {}).get("prompts")}
    return {key: os.path.basename(path) if os.path.isabs(path) else path for key, path in paths.items()
            if path and not path.startswith("verifiers:")}


@pytest.fixture(scope="module")
def docs_judge(docs_directory):
    """A tiny judge (demos/judge.py) with Yes and No among its tokens, for the docs' judges."""
    from demos.judge import build_judge

    return build_judge(str(docs_directory / "judge"), steps=20, log=lambda *_: None)


@pytest.fixture(scope="module")
def docs_openenv_url(docs_directory):
    """The docs' OpenEnv server, started once for the configs that play against one."""
    with docs_openenv_server(docs_directory) as url:
        yield url


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNNABLE)
def test_every_whole_config_of_the_readme_and_docs_trains_a_step_from_its_directory(name, docs_directory, tiny_assets,
                                                                                      request):
    """`tether run -c <config>` of each whole config the README and docs/ give, from the directory a
    user runs it in, its models the tiny ones, made as small as a run gets (ONE_STEP): it exits 0 and
    the learner trains its step. An OpenEnv config's server is the docs', started for it."""
    text, config = doc_configs()[name]
    slug = re.sub(r"\W", "_", name)
    path = name if name.endswith((".yaml", ".yml")) else f"{slug}.yaml"
    (docs_directory / path).write_text(text)
    models = {"policy": str(docs_directory / "policy"), "reference": str(docs_directory / "policy"),
              "reward": tiny_assets["reward"], "teacher": tiny_assets["base"]}  # a teacher of the policy's tokens
    overrides = [f"models.{key}={models[key]}" for key, value in config["models"].items() if key in models and value]
    # each its own run directory (two configs may share one, or name a cluster's), its files in this one
    run_dir = f"runs/{slug}"
    overrides += [f"run_dir={run_dir}", *(f"{key}={path}" for key, path in data_files(config).items())]
    if str((config.get("rollout") or {}).get("environment", "")).startswith("openenv:"):
        overrides.append(f"rollout.environment=openenv:{request.getfixturevalue('docs_openenv_url')}")
    judges = (config.get("scorer") or {}).get("judges")
    if judges:  # the docs' judges are hub models: the tiny judge in their place, their templates their own
        judge = request.getfixturevalue("docs_judge")
        overrides.append("scorer.judges=" + json.dumps([{**entry, "model": judge} for entry in judges]))
    result = tether_from(docs_directory, "run", "-c", path,
                         *(item for override in [*overrides, *ONE_STEP] for item in ("-o", override)))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [record["step"] for record in read_metrics(str(docs_directory / run_dir), "learner")] == [1]
