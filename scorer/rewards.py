"""Rule-based / verifiable reward functions: ``"module:function"`` specs from the config, called
on decoded text and tokens, their weighted sum added to the reward model's score.

A function names the keywords it wants, out of ``prompt`` and ``response`` (text, decoded with
the policy's tokenizer, special tokens dropped), ``prompt_tokens`` and ``response_tokens`` (ids)
``row`` (the prompt's row of the data file: an ``answer`` to check against) and ``messages`` (an
episode's conversation, a list of ``{"role", "content"}``; None for a single response), or takes
``**kwargs`` for all of them. One that raises, or returns something that is not a finite number,
counts 0 for that sample and is reported with its name and the sample; the batch goes on.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

from common.functions import load_function

ARGUMENTS = ("prompt", "response", "prompt_tokens", "response_tokens", "row", "messages")


def wanted_arguments(function: Callable[..., Any]) -> tuple[str, ...]:
    """The arguments ``function`` gets: those of ``ARGUMENTS`` it names (all with ``**kwargs``).
    A parameter it needs that is not one of them is an error; one with a default is left alone."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return ARGUMENTS
    named = [p for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                 inspect.Parameter.KEYWORD_ONLY)]
    unknown = [p.name for p in named if p.name not in ARGUMENTS and p.default is inspect.Parameter.empty]
    if unknown or any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in parameters):
        raise TypeError(f"it asks for {unknown or 'positional-only arguments'}; a reward function gets "
                        f"{', '.join(ARGUMENTS)} by name")
    return tuple(p.name for p in named if p.name in ARGUMENTS)


@dataclass
class RewardFunction:
    name: str  # the "module:function" spec: how it is named in logs and metrics
    function: Callable[..., Any]
    weight: float
    arguments: tuple[str, ...]  # what it is called with

    @staticmethod
    def load(spec: str, weight: float, key: str) -> "RewardFunction":
        function = load_function(spec, key, check=wanted_arguments)
        return RewardFunction(spec, function, weight, wanted_arguments(function))

    def __call__(self, sample_id: str, arguments: dict[str, Any], log: logging.Logger) -> float | None:
        """The function's value for one sample; None (and a warning naming both) if it fails."""
        try:
            value = float(self.function(**{name: arguments[name] for name in self.arguments}))
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
            return value
        except Exception as error:
            log.warning("reward function %s failed on sample %s (response %r): %s: %s; it counts 0 for this sample",
                        self.name, sample_id, arguments["response"][:200], type(error).__name__, error)
            return None
