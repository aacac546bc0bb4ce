"""User code named in the config as ``"module:function"``: reward functions, tools, environments."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from common.config import ConfigError


def load_function(spec: str, key: str, check: Callable[[Callable[..., Any]], Any] | None = None) -> Callable[..., Any]:
    """``module:function`` -> the function; ``check`` (raising) says whether it is usable. Any
    failure is a ConfigError naming the config key."""
    module_name, _, function_name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
        if check is not None:
            check(function)
    except Exception as error:  # not importable, a broken module, no such function, refused by check
        raise ConfigError(f"{key}: cannot import {spec!r} (expected module:function): "
                          f"{type(error).__name__}: {error}") from None
    return function
