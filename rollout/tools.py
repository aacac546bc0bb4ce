"""Tool calls: plain Python functions from the config, their JSON schemas for the policy's chat
template, calls parsed from the policy's own text, results as tool messages.

The call format is the one Qwen's and Hermes' chat templates teach (``<tool_call>`` around a JSON
object with ``name`` and ``arguments``), the form most open chat models with tools use. Nothing a
policy writes and nothing a tool does crashes the rollout: a malformed call, an unknown tool, a
tool that raises or returns something JSON cannot hold each become an error message that the
policy reads as the tool's answer, and are counted.
"""

from __future__ import annotations

import inspect
import json
import re
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from common.config import ConfigError
from common.functions import load_function

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


@dataclass
class Tool:
    name: str
    function: Callable[..., Any]
    schema: dict  # {"type": "function", "function": {name, description, parameters}}: what the template renders

    @staticmethod
    def load(spec: str, key: str) -> "Tool":
        function = load_function(spec, key, check=lambda function: inspect.signature(function))
        return Tool(function.__name__, function, json_schema(function))


def json_schema(function: Callable[..., Any]) -> dict:
    """The function's schema as chat templates take it: transformers' ``get_json_schema`` where the
    docstring describes every argument (Google style), else one built from the signature alone, so
    a plain function without a docstring is still a tool."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception:  # no docstring, an undocumented argument, a type it cannot map
        pass
    properties, required = {}, []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        kind = _JSON_TYPES.get(parameter.annotation)
        properties[parameter.name] = {"type": kind} if kind else {}
        if parameter.default is inspect.Parameter.empty:
            required.append(parameter.name)
    description = (inspect.getdoc(function) or function.__name__).split("\n")[0]
    return {"type": "function", "function": {"name": function.__name__, "description": description,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


@dataclass
class ToolCall:
    name: str | None  # None: the call could not be read
    arguments: dict
    error: str | None = None  # why it could not be read


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in ``text``, in order; one
    that is not such a JSON object comes back with its ``error`` (``arguments`` may also be a JSON
    string of an object, as some models write it)."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError('a tool call is a JSON object with a "name"')
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(arguments, dict):
                raise ValueError('a tool call\'s "arguments" is a JSON object')
            calls.append(ToolCall(call["name"], arguments))
        except ValueError as error:  # json's errors are ValueErrors too
            calls.append(ToolCall(None, {}, f"malformed tool call: {error}"))
    return calls


@dataclass
class ToolError:
    """What went wrong with one call: its ``kind`` (``malformed``, ``unknown_tool``, ``raised``,
    ``unserialisable``: what ``tool_errors`` counts), the tool and arguments, and the detail
    (a raised error's traceback) for the rollout's log."""
    kind: str
    tool: str | None
    arguments: dict
    detail: str


def call_tool(tools: dict[str, Tool], call: ToolCall) -> tuple[str, ToolError | None]:
    """The tool message's content for ``call``, and what went wrong if anything did (then the
    content is that error, for the policy to read)."""
    if call.name is None:
        return f"error: {call.error}", ToolError("malformed", None, {}, call.error or "")
    tool = tools.get(call.name)
    if tool is None:
        message = f"unknown tool {call.name!r}; the tools are {', '.join(sorted(tools))}"
        return f"error: {message}", ToolError("unknown_tool", call.name, call.arguments, message)
    try:
        result = tool.function(**call.arguments)
    except Exception as error:
        return (f"error: {call.name} raised {type(error).__name__}: {error}",
                ToolError("raised", call.name, call.arguments, traceback.format_exc()))
    if isinstance(result, str):
        return result, None
    try:
        return json.dumps(result), None
    except (TypeError, ValueError) as error:
        message = f"{call.name} returned {type(result).__name__}, which JSON cannot hold ({error})"
        return f"error: {message}", ToolError("unserialisable", call.name, call.arguments, message)


def load_tools(specs: list[str]) -> dict[str, Tool]:
    """``rollout.tools`` -> the tools by name; two with one name is an error naming both."""
    tools: dict[str, Tool] = {}
    for i, spec in enumerate(specs):
        tool = Tool.load(spec, f"rollout.tools[{i}]")
        if tool.name in tools:
            raise ConfigError(f"rollout.tools[{i}]: {spec!r} is named {tool.name!r}, like another tool")
        tools[tool.name] = tool
    return tools
