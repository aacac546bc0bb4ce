"""rollout.environment openenv:<url>: episodes against real OpenEnv servers (openenv's own server
API, tests/openenv_servers.py, served by uvicorn on 127.0.0.1), the policy's turns given by hand:
a session per episode, the observation's text as the user's turn, its reward and done; an MCP
server's tools as the policy's, a call in a turn a call_tool step; a server that is down is a
ConfigError before anything runs, and one that refuses a step fails its episode."""

import pytest

from common.config import ConfigError, load_config
from environments.interface import Step, Turn
from environments.native import Environments, prompt_tools
from tests.helpers import chatml_tokenizer, first_of, step_of


@pytest.fixture(scope="module")
def servers():
    """Both servers' URLs, each uvicorn in a thread of its own on a free port (openenv-core: the
    Makefile installs it; no skip, so a missing install fails here)."""
    from environments.endpoint import serve_in_thread
    from tests import openenv_servers

    urls, running = {}, []
    for name in ("sums", "calculator"):
        server, _, port = serve_in_thread(getattr(openenv_servers, name), name)
        urls[name], running = f"http://127.0.0.1:{port}", [*running, server]
    yield urls
    for server in running:
        server.should_exit = True


def test_a_text_environments_episodes_each_have_a_session_of_their_own(servers):
    environments = Environments.load(f"openenv:{servers['sums']}", {}, step_deadline_s=5.0)
    first, second = environments.make({"prompt": "-"}), environments.make({"reset": {"a": 1, "b": 2}})
    assert first_of(first) == "What is 17 plus 25?" and first_of(second) == "What is 1 plus 2?"
    assert first.inner.tools is None  # no MCP tools: the run's template renders none
    assert step_of(first, "41", []) == Step("turn 1: no", 0.0, False)
    assert step_of(second, "It is 3", []) == Step("right", 1.0, True)  # its own session: its own numbers
    assert step_of(first, "maybe 40", []) == Step("turn 2: no", 0.0, False)  # the first's turns counted on
    assert step_of(first, "42", []) == Step("right", 1.0, True)
    first.close(), second.close()


def test_an_mcp_servers_tools_are_the_policys_and_its_calls_are_call_tool_steps(servers, tmp_path):
    environments = Environments.load(f"openenv:{servers['calculator']}", {}, step_deadline_s=5.0)
    tokenizer = chatml_tokenizer(str(tmp_path))
    environments.read_calls_with("hermes", tokenizer)
    episode = environments.make({"prompt": "What is 5 plus 7?"})
    # its first observation says nothing: the row's prompt, rendered with the server's tools
    assert first_of(episode) == [{"role": "user", "content": "What is 5 plus 7?"}]
    assert sorted(tool["function"]["name"] for tool in episode.inner.tools) == ["add", "fail"]
    add = next(tool for tool in episode.inner.tools if tool["function"]["name"] == "add")["function"]
    assert add["description"] == "Add two integers." and add["parameters"]["required"] == ["a", "b"]
    turn = '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 7}}\n</tool_call>'
    ids = tokenizer(turn, add_special_tokens=False)["input_ids"]
    step = step_of(episode, turn, [], Turn(3, ids, [0.0] * len(ids)))
    assert step.observation == [{"role": "tool", "name": "add", "content": "12"}] and step.tool_calls == 1
    assert not step.tool_errors and not step.done
    step = step_of(episode, '<tool_call>\n{"name": "fail", "arguments": {"reason": "no luck"}}\n</tool_call>', [])
    assert step.observation[0]["content"].startswith("error:") and "no luck" in step.observation[0]["content"]
    assert [(error.kind, error.tool) for error in step.tool_errors] == [("raised", "fail")]
    assert step_of(episode, "The answer is 12.", []) == Step(done=True)  # tools alone: an answer ends it
    episode.close()


def test_a_server_that_is_down_or_refuses_is_said_so(servers):
    from protocol.transport import free_port
    from environments.native import OpenEnvEnvironment
    from environments.openenv import OpenEnv

    with pytest.raises(ConfigError, match="rollout.environment: the OpenEnv server at http://127.0.0.1:[0-9]+ "
                                          "does not answer"):
        Environments.load(f"openenv:http://127.0.0.1:{free_port()}", {})
    with pytest.raises(ConfigError, match="an OpenEnv server's tools are its own"):
        Environments.load(f"openenv:{servers['sums']}", {"add": object()})
    episode = OpenEnvEnvironment(OpenEnv(servers["sums"], action=lambda text: {"words": text}), {})
    episode.reset()
    with pytest.raises(RuntimeError, match="the OpenEnv server refused step: .*VALIDATION_ERROR"):
        episode.step("42", [])
    episode.close()
    failing = Environments.load(f"openenv:{servers['sums']}", {}).make({"reset": {"a": "seventeen"}})
    with pytest.raises(RuntimeError, match="the OpenEnv server refused reset"):
        first_of(failing)
    assert failing.inner.session is None  # closed: the server's session does not outlive the episode


def test_a_send_to_a_server_that_stops_reading_fails_within_the_step_deadline():
    """A session's send waits for room in the socket's buffer: to a server that stops reading (it
    answers the WebSocket handshake, then reads no more) it fails within the step's deadline
    (SO_SNDTIMEO) rather than hold its thread for good."""
    import base64
    import hashlib
    import socket
    import threading
    import time

    from environments.openenv import OpenEnv, Session

    listener = socket.create_server(("127.0.0.1", 0))
    held = []

    def handshake_then_never_read() -> None:
        connection, _ = listener.accept()
        request = b""
        while b"\r\n\r\n" not in request:
            request += connection.recv(4096)
        key = next(line.split(b":", 1)[1].strip() for line in request.split(b"\r\n")
                   if line.lower().startswith(b"sec-websocket-key"))
        accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        connection.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                           b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
        held.append(connection)

    threading.Thread(target=handshake_then_never_read, daemon=True).start()
    openenv = OpenEnv.__new__(OpenEnv)  # the session alone: this server speaks nothing past the handshake
    openenv.url, openenv.deadline_s = f"http://127.0.0.1:{listener.getsockname()[1]}", 1.0
    session = Session(openenv)
    started = time.monotonic()
    with pytest.raises(Exception):
        for _ in range(1000):  # up to 1 GB: far past what the socket's buffers hold
            session.socket.send("x" * (1 << 20))
    assert time.monotonic() - started < 10.0
    session.socket.close()
    for connection in [*held, listener]:
        connection.close()


# --------------------------------------------------------------------------- the prompt-length filter
# counts the tool schemas the chat template renders into each prompt: rollout.tools', an OpenEnv
# server's MCP tools, a verifiers environment's (issue 52)

def run_of(environment: str):
    return load_config(None, [f"rollout.environment={environment}"],
                       base={"models": {"policy": "/p", "reward": None}, "data": {"prompts": "/d.jsonl"}})


def test_an_openenv_servers_tools_count_in_each_prompts_length(servers):
    calculator = Environments.load(f"openenv:{servers['calculator']}", {}, step_deadline_s=5.0)
    tools = prompt_tools(run_of(f"openenv:{servers['calculator']}"), calculator)
    assert tools == calculator.server.tools and len(tools) == 2  # what each episode renders
    sums = Environments.load(f"openenv:{servers['sums']}", {}, step_deadline_s=5.0)
    assert prompt_tools(run_of(f"openenv:{servers['sums']}"), sums) is None  # a server without MCP tools


def test_a_verifiers_environments_tools_and_the_runs_own_count_too():
    agent = Environments(lambda row: None, {})  # a verifiers environment's episodes are an agent program's
    tools = prompt_tools(run_of("verifiers:demos.agent_verifiers"), agent)
    assert [tool["function"]["name"] for tool in tools] == ["calculator"]
    from environments.tools import load_tools

    native = Environments.load(None, load_tools(["demos.agent:calculator"]))
    assert prompt_tools(run_of("my_env:make"), native) == native.tool_schemas
    assert prompt_tools(run_of("my_env:make"), None) is None
