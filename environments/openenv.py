"""OpenEnv environment servers as tether's environments (``rollout.environment: openenv:<url>``).

An OpenEnv server (``openenv``, ``openenv-core``: ``create_app(Environment, Action, Observation)``)
keeps an episode's state in a WebSocket session (``/ws``; its HTTP ``/reset`` and ``/step`` make
a new environment for each request), so each episode here opens a session of its own and speaks
the server's messages: ``{"type": "reset", "data": {...}}``, ``{"type": "step", "data": <action>}``,
each answered ``{"type": "observation", "data": {"observation", "reward", "done"}}`` (or
``{"type": "error", ...}``), and ``{"type": "close"}``. The protocol is small and the same in both
releases, so tether speaks it itself (``websockets``) and environments built with either work.

- The policy's turn is the action's one text field (found in the server's ``/schema``: the one
  string field the action requires), or what ``OpenEnv(url, action=...)`` makes of it.
- The observation's text (its one text field, else its JSON) is the user's next message; its
  ``reward`` is the turn's, its ``done`` ends the episode.
- Tools: an MCP environment's tools (``tools/list`` on the server's ``/mcp``) are the policy's,
  rendered by its chat template; a call in a turn (read by ``rollout.tool_parser``) is a step of
  ``{"type": "call_tool", ...}`` and its result a tool message. A turn without a call is the
  episode's answer: a step of the text action where the server has one, else the episode's end.
- A server that is down at the start is a ``ConfigError`` before anything trains (the rollout's
  preflight); one that dies, refuses or does not answer within ``rollout.env_step_deadline_s``
  ends its episode (``env_error``, ``env_deadline``).
"""

from __future__ import annotations

import importlib.util
import json
import socket
import struct
import threading
import urllib.error
import urllib.request
from typing import Callable

from common.config import ConfigError

PREFIX = "openenv:"
CONNECT_DEADLINE_S = 10.0
CLOSE_DEADLINE_S = 5.0  # the server's close after ours (the episode's end waits in a thread of its own)


class OpenEnv:
    """An OpenEnv server: its action's text field or ``action(text) -> dict``, its tools, checked
    at once (a server that is down or whose action takes no text is a ``ConfigError``); each
    episode a ``Session`` (``environments.native.OpenEnvEnvironment``)."""

    def __init__(self, url: str, action: Callable[[str], dict] | None = None, deadline_s: float = 30.0,
                 key: str = "rollout.environment") -> None:
        self.url, self.deadline_s = url.rstrip("/"), deadline_s
        if importlib.util.find_spec("websockets") is None:
            raise ConfigError(f"{key}: an OpenEnv server's episodes need the websockets package: pip install "
                              "'tether[openenv]'")
        try:
            schema = _get_json(f"{self.url}/schema")
        except (OSError, ValueError) as error:
            raise ConfigError(f"{key}: the OpenEnv server at {self.url} does not answer ({error}); start it before "
                              "the run") from None
        self.tools = self._list_tools()
        self.action = action or _text_action(schema.get("action", {}), self.tools, key, self.url)
        self.parser = None  # environments.tools.ToolCallParser of the tools, from Environments.read_calls_with

    def _list_tools(self) -> list[dict] | None:
        """The server's MCP tools as OpenAI function schemas (None without any)."""
        request = {"jsonrpc": "2.0", "method": "tools/list", "id": 1}
        try:
            answer = _post_json(f"{self.url}/mcp", request)
        except (OSError, ValueError):  # a server without MCP
            return None
        tools = (answer.get("result") or {}).get("tools") or []
        return [{"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description") or "",
            "parameters": tool.get("input_schema") or tool.get("inputSchema") or {"type": "object"}}}
            for tool in tools] or None


class Session:
    """One episode's WebSocket session of the server's, opened at once, closed at the episode's end."""

    def __init__(self, server: OpenEnv) -> None:
        from websockets.sync.client import connect

        self.server = server
        ws_url = "ws" + server.url.removeprefix("http") + "/ws"
        # entered as a context (closed by close()): websockets 17 deprecates a connection used otherwise
        self.socket = connect(ws_url, open_timeout=CONNECT_DEADLINE_S, close_timeout=1.0,
                              max_size=2 ** 27).__enter__()
        # a send waits for room in the socket's buffer: a server that stops reading fails the send
        # within the step's deadline, as one that stops answering fails the wait for its answer
        # (SO_SNDTIMEO bounds sends alone; the connection's reader thread keeps its blocking reads)
        seconds = server.deadline_s
        self.socket.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                                      struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))
        self.lock = threading.Lock()  # one message at a time: a step's answer before the close

    def reset(self, arguments: dict) -> str:
        """The reset's observation as the user's first message."""
        return observation_text(self.send({"type": "reset", "data": arguments}).get("observation"))

    def step(self, action: dict) -> tuple[dict, float, bool]:
        """(observation, reward, done) of a step of ``action``."""
        answer = self.send({"type": "step", "data": action})
        return answer.get("observation") or {}, float(answer.get("reward") or 0.0), bool(answer.get("done"))

    def send(self, message: dict) -> dict:
        """One message and its answer, within the step's deadline (each of the send and the answer;
        the wait for a close under way: CLOSE_DEADLINE_S); the server's error raised."""
        if not self.lock.acquire(timeout=CLOSE_DEADLINE_S):
            raise TimeoutError(f"the OpenEnv session was busy for {CLOSE_DEADLINE_S:g}s (closing)")
        try:
            self.socket.send(json.dumps(message))
            answer = json.loads(self.socket.recv(timeout=self.server.deadline_s))
        finally:
            self.lock.release()
        if answer.get("type") == "error":
            data = answer.get("data") or {}
            raise RuntimeError(f"the OpenEnv server refused {message['type']}: {data.get('message')} "
                               f"({data.get('code')})")
        return answer.get("data") or {}

    def close(self) -> None:
        """The session's end, as the server's own client ends it: ``close``, then the server closes
        the connection (closed from this side first, the server logs its own close failing)."""
        # a step under way (the run's end closes episodes mid-step) is answered first, briefly
        if self.lock.acquire(timeout=CLOSE_DEADLINE_S):
            try:
                self.socket.send(json.dumps({"type": "close"}))
                self.socket.recv(timeout=CLOSE_DEADLINE_S)
            except Exception:  # closed by the server, as expected; or already gone
                pass
            finally:
                self.lock.release()
        self.socket.close()


def _text_action(schema: dict, tools: list[dict] | None, key: str, url: str) -> Callable[[str], dict] | None:
    """The action of a turn's text: the one string field the action requires. None for an
    environment of tools alone (its action is a tool call)."""
    properties, required = schema.get("properties", {}), schema.get("required", [])
    if tools and ("tool_name" in properties or not properties):  # MCP's CallToolAction
        return None
    texts = [name for name in required if properties.get(name, {}).get("type") == "string"]
    if len(texts) == 1 and len(required) == 1:
        field = texts[0]
        return lambda text: {field: text}
    raise ConfigError(f"{key}: the OpenEnv server at {url} takes actions of {sorted(properties)} (required "
                      f"{required}), not one text field: make its episodes with environments.openenv.OpenEnv(url, "
                      "action=lambda text: {...}) in a factory of your own")


def observation_text(observation: dict | None) -> str:
    """An observation as the user's message: its one text field, else its fields as JSON (its
    reward and done travel beside it; metadata is the environment's, not the policy's)."""
    fields = {k: v for k, v in (observation or {}).items() if k not in ("metadata", "reward", "done") and v is not None}
    texts = [value for value in fields.values() if isinstance(value, str)]
    if len(texts) == 1 and len(fields) == 1:
        return texts[0]
    return json.dumps(fields, sort_keys=True) if fields else ""


def tool_result(observation: dict) -> tuple[str, str | None]:
    """A call_tool step's observation as the tool message's content, and the error it reports."""
    error = observation.get("error")
    if error:
        detail = error.get("message") or error.get("error_type") if isinstance(error, dict) else str(error)
        return f"error: {detail}", str(detail)
    result = observation.get("result") or {}
    if isinstance(result, dict):
        if result.get("is_error"):
            text = "".join(part.get("text", "") for part in result.get("content") or [])
            return f"error: {text}", text
        if result.get("data") is not None:
            data = result["data"]
            return data if isinstance(data, str) else json.dumps(data), None
        return "".join(part.get("text", "") for part in result.get("content") or []), None
    return result if isinstance(result, str) else json.dumps(result), None


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=CONNECT_DEADLINE_S) as answer:
        return json.loads(answer.read())


def _post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=CONNECT_DEADLINE_S) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as error:
        raise OSError(f"{url}: HTTP {error.code}") from None
