"""Rule-based / verifiable reward functions: ``"module:function"`` specs from the config, called
on decoded text and tokens, their weighted sum added to the reward model's score.

A function names the keywords it wants, out of ``prompt`` and ``response`` (text, decoded with
the policy's tokenizer, special tokens dropped), ``prompt_tokens`` and ``response_tokens`` (ids)
and ``row`` (the prompt's row of the data file: an ``answer`` to check against), or takes
``**kwargs`` for all of them. One that raises, or returns something that is not a finite number,
counts 0 for that sample and is reported with its name and the sample; the batch goes on.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

from protocol.config import ConfigError

ARGUMENTS = ("prompt", "response", "prompt_tokens", "response_tokens", "row")


def load_function(spec: str, key: str) -> Callable[..., Any]:
    """``module:function`` -> the function; the error names the config key."""
    module_name, _, function_name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"{key}: cannot import {spec!r} (expected module:function): {error}") from None
    if not callable(function):
        raise ConfigError(f"{key}: {spec!r} is not a function")
    wanted = _wanted_arguments(function)
    unknown = [name for name in wanted if name not in ARGUMENTS]
    if unknown:
        raise ConfigError(f"{key}: {spec!r} asks for {unknown}; a reward function gets {', '.join(ARGUMENTS)}")
    return function


def _wanted_arguments(function: Callable[..., Any]) -> tuple[str, ...]:
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return ARGUMENTS
    return tuple(p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                          inspect.Parameter.KEYWORD_ONLY))


@dataclass
class RewardFunction:
    name: str  # the "module:function" spec: how it is named in logs and metrics
    function: Callable[..., Any]
    weight: float

    @staticmethod
    def load(spec: str, weight: float, key: str) -> "RewardFunction":
        return RewardFunction(spec, load_function(spec, key), weight)

    def __call__(self, sample_id: str, arguments: dict[str, Any], log: logging.Logger) -> float | None:
        """The function's value for one sample; None (and a warning naming both) if it fails."""
        wanted = _wanted_arguments(self.function)
        try:
            value = self.function(**{name: arguments[name] for name in wanted})
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
            return value
        except Exception as error:
            response = arguments["response"]
            log.warning("reward function %s failed on sample %s (response %r): %s: %s; it counts 0 for this sample",
                        self.name, sample_id, response[:200], type(error).__name__, error)
            return None
