"""The prompt-length filter counts the tool schemas the chat template renders into each prompt
(issue 52): rollout.tools', an OpenEnv server's MCP tools, a verifiers environment's."""

import pytest

from common.config import load_config
from rollout.environments import Environments, prompt_tools


@pytest.fixture(scope="module")
def servers():
    """The OpenEnv test servers' URLs (tests/openenv_servers.py), each uvicorn in a thread of its own."""
    from rollout.endpoint import serve_in_thread
    from tests import openenv_servers

    urls, running = {}, []
    for name in ("sums", "calculator"):
        server, _, port = serve_in_thread(getattr(openenv_servers, name), name)
        urls[name], running = f"http://127.0.0.1:{port}", [*running, server]
    yield urls
    for server in running:
        server.should_exit = True


def run_of(environment: str):
    return load_config(None, [f"rollout.environment={environment}"],
                       base={"models": {"policy": "/p", "reward": None}, "data": {"prompts": "/d.jsonl"}})


def test_an_openenv_servers_tools_count_in_each_prompts_length(servers):
    calculator = Environments.load(f"openenv:{servers['calculator']}", {}, step_deadline_s=5.0)
    tools = prompt_tools(run_of(f"openenv:{servers['calculator']}"), calculator)
    assert tools == calculator.make({"prompt": "-"}).tools and len(tools) == 2  # what each episode renders
    sums = Environments.load(f"openenv:{servers['sums']}", {}, step_deadline_s=5.0)
    assert prompt_tools(run_of(f"openenv:{servers['sums']}"), sums) is None  # a server without MCP tools


def test_a_verifiers_environments_tools_and_the_runs_own_count_too():
    agent = Environments(lambda row: None, {})  # a verifiers environment's episodes are an agent program's
    tools = prompt_tools(run_of("verifiers:demos.agent_verifiers"), agent)
    assert [tool["function"]["name"] for tool in tools] == ["calculator"]
    from rollout.tools import load_tools

    native = Environments.load(None, load_tools(["demos.agent:calculator"]))
    assert prompt_tools(run_of("my_env:make"), native) == native.tool_schemas
    assert prompt_tools(run_of("my_env:make"), None) is None
