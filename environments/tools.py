"""Tool calls: plain Python functions from the config, their JSON schemas for the policy's chat
template, calls read from the policy's own text by vLLM's parser for the family
(``rollout.tool_parser``; hermes, the default, reads the ``<tool_call>`` JSON that Qwen's and
Hermes' templates teach), results as tool messages. Nothing a policy writes and nothing a tool
does crashes the rollout: a malformed call, an unknown tool, a tool that raises or returns
something JSON cannot hold each become an error message that the policy reads as the tool's
answer, and are counted.
"""

from __future__ import annotations

import inspect
import json
import logging
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from common.config import ConfigError
from common.functions import load_function
from environments.interface import ToolError, is_part

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


@dataclass
class Tool:
    name: str
    function: Callable[..., Any]
    # {"type": "function", "function": {name, description, parameters}}: what the template renders; None
    # where only the function was checked (tether run's preflight: its schema needs transformers, which
    # imports torch, seconds before any role could start)
    schema: dict | None

    @staticmethod
    def load(spec: str, key: str, schema: bool = True) -> "Tool":
        function = load_function(spec, key, check=lambda function: inspect.signature(function))
        return Tool(function.__name__, function, json_schema(function) if schema else None)


def json_schema(function: Callable[..., Any]) -> dict:
    """The function's schema as chat templates take it: transformers' ``get_json_schema`` where the
    docstring describes every argument (Google style), else one built from the signature alone, so
    a plain function without a docstring is still a tool. Either is an OpenAI function definition:
    ``get_json_schema``'s ``return`` is left out, as vLLM's request model leaves it out of an agent
    program's tools, so that a tool renders alike on both paths (a policy tuned on one reads the other)."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(function)
        schema["function"].pop("return", None)
        return schema
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


class ToolCallParser:
    """vLLM's tool-call parser for the model family, by the name ``vllm serve --tool-call-parser``
    takes (``rollout.tool_parser``: hermes, llama3_json, mistral, pythonic, qwen3_coder, ...): the
    calls in a turn of the policy's text, as vLLM's OpenAI server would return them.

    vLLM's parsers read a turn whole or not at all; a turn that begins a call (the parser's start
    marker is in it: ``<tool_call>``, ``<|python_tag|>``, ``[TOOL_CALLS]``) and cannot be read is
    one malformed call, which the policy reads as an error, rather than its final answer."""

    MARKERS = ("tool_call_start_token", "bot_token")  # what vLLM's parsers call a call's start

    def __init__(self, name: str, tokenizer, schemas: list[dict] | None, reasoning: str | None = None) -> None:
        """``reasoning``: vLLM's reasoning parser for the family (``rollout.reasoning_parser``), whose
        reasoning is set apart before calls are read in the content, as vLLM's server does."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        try:
            parser_class = ToolParserManager.get_tool_parser(name)
        except KeyError:
            raise ConfigError(f"rollout.tool_parser: {name!r} is not one of vLLM's tool-call parsers "
                              f"({', '.join(sorted(tool_parser_names()))})") from None
        self.request = ChatCompletionRequest(messages=[{"role": "user", "content": ""}], model="policy",
                                             tools=schemas or None)
        try:
            self.parser = parser_class(tokenizer, self.request.tools)
        except (RuntimeError, ValueError) as error:  # the family's special tokens are not in this tokenizer
            raise ConfigError(f"rollout.tool_parser: {name} does not fit the policy's tokenizer ({error})") from None
        self.name, self.tokenizer = name, tokenizer
        self.reasoning = ReasoningParser(reasoning, tokenizer, self.request) if reasoning else None
        self.markers = [marker for marker in (getattr(self.parser, attribute, None) for attribute in self.MARKERS)
                        if isinstance(marker, str) and marker]
        # a turn it cannot read is logged by vLLM with a traceback; tether counts it as a tool error
        parser_log = logging.getLogger(type(self.parser).__module__)
        if _below_error not in parser_log.filters:
            parser_log.addFilter(_below_error)

    def text_of(self, token_ids: list[int]) -> str:
        """A turn's text as the parser reads it: special tokens kept, since some families' call
        markers are (Mistral's [TOOL_CALLS], Llama's <|python_tag|>) and vLLM's parsers read them
        (its server keeps them for the parsers that ask), the token the turn stopped at left out."""
        if token_ids and token_ids[-1] in self.tokenizer.all_special_ids:
            token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def parse(self, text: str) -> list[ToolCall]:
        """The turn's calls in order; ``[]`` for a turn without one (the episode's answer)."""
        if self.reasoning is not None:
            text = self.reasoning.split(text)[1]
        found = self.parser.extract_tool_calls(text, self.request)
        if not found.tools_called:
            unread = self._unread(text)
            return [] if unread is None else [ToolCall(None, {}, unread)]
        calls = []
        for call in found.tool_calls:
            try:
                arguments = json.loads(call.function.arguments or "{}")
                if isinstance(arguments, str):  # some models write the arguments as a JSON string of an object
                    arguments = json.loads(arguments)
                if not isinstance(arguments, dict):
                    raise ValueError('a tool call\'s "arguments" is a JSON object')
                calls.append(ToolCall(call.function.name, arguments))
            except ValueError as error:  # json's errors are ValueErrors too
                calls.append(ToolCall(None, {}, f"malformed tool call: {error}"))
        return calls

    def openai_calls(self, text: str, request) -> tuple[str | None, list, str | None]:
        """(content, vLLM's ``ToolCall``s, why a call could not be read) of a turn, as vLLM's server
        answers ``request`` (a ``ChatCompletionRequest`` with the caller's tools): a turn without a
        call is all content, and so is one whose call the parser cannot read, with the reason."""
        if not request.tools or request.tool_choice == "none":
            return text, [], None
        found = self.parser.extract_tool_calls(text, request)
        if found.tools_called:
            return found.content, list(found.tool_calls), None
        return text, [], self._unread(text)

    def _unread(self, text: str) -> str | None:
        """Why a turn the parser found no call in holds a malformed one: it begins a call (the
        parser's start marker is in it); None for a turn without a call."""
        if any(marker in text for marker in self.markers):
            return f"malformed tool call: the {self.name} parser could not read it"
        return None


class ReasoningParser:
    """vLLM's reasoning parser by the name ``vllm serve --reasoning-parser`` takes
    (``rollout.reasoning_parser``: qwen3, deepseek_r1, mistral, ...): a turn's reasoning apart from
    its content."""

    def __init__(self, name: str, tokenizer, request) -> None:
        from vllm.reasoning import ReasoningParserManager

        try:
            parser_class = ReasoningParserManager.get_reasoning_parser(name)
        except KeyError:
            raise ConfigError(f"rollout.reasoning_parser: {name!r} is not one of vLLM's reasoning parsers "
                              f"({', '.join(sorted(ReasoningParserManager.list_registered()))})") from None
        try:
            self.parser = parser_class(tokenizer)
        except (RuntimeError, ValueError) as error:  # the family's think tokens are not in this tokenizer
            raise ConfigError(f"rollout.reasoning_parser: {name} does not fit the policy's tokenizer "
                              f"({error})") from None
        self.request = request

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a turn."""
        reasoning, content = self.parser.extract_reasoning(text, self.request)
        return reasoning, content or ""


def _below_error(record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR


def tool_parser_names() -> list[str]:
    """The names vLLM's tool-parser registry holds (its built-in parsers)."""
    from vllm.tool_parsers import ToolParserManager

    return list(ToolParserManager.list_registered())


def call_tool(tools: dict[str, Tool], call: ToolCall, shows_images: bool = False
              ) -> tuple[str | list[dict], ToolError | None]:
    """The tool message's content for ``call``, and what went wrong if anything did (then the
    content is that error, for the policy to read). A result of text is the content; an image (a PIL
    image) or a list of text and image parts (``{"type": "text", "text": ...}``, ``{"type":
    "image", ...}``: common.images.part_image) is shown as parts where the policy sees images
    (``shows_images``; an image to one that does not is an error it reads); anything else is its
    JSON."""
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
    parts = _parts(result)
    if parts is not None:
        if shows_images or all(part["type"] == "text" for part in parts):
            return parts, None
        message = f"{call.name} returned an image, and the policy does not see images"
        return f"error: {message}", ToolError("unserialisable", call.name, call.arguments, message)
    try:
        return json.dumps(result), None
    except (TypeError, ValueError) as error:
        message = f"{call.name} returned {type(result).__name__}, which JSON cannot hold ({error})"
        return f"error: {message}", ToolError("unserialisable", call.name, call.arguments, message)


def _parts(result: Any) -> list[dict] | None:
    """A tool's result as message parts, where it is an image (a PIL image) or a list of text and
    image parts; else None."""
    if hasattr(result, "save") and hasattr(result, "size"):  # a PIL image
        return [{"type": "image", "image": result}]
    if isinstance(result, list) and result and all(map(is_part, result)):
        return result
    return None


def load_tools(specs: list[str], schemas: bool = True) -> dict[str, Tool]:
    """``rollout.tools`` -> the tools by name (``schemas``: with their schemas); two with one name is
    an error naming both."""
    tools: dict[str, Tool] = {}
    for i, spec in enumerate(specs):
        tool = Tool.load(spec, f"rollout.tools[{i}]", schemas)
        if tool.name in tools:
            raise ConfigError(f"rollout.tools[{i}]: {spec!r} is named {tool.name!r}, like another tool")
        tools[tool.name] = tool
    return tools
