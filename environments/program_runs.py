"""How one episode's agent program runs, in the rollout's program threads and in a program process
alike: the client it is given, and the deadline it is held to."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable

from environments.interface import PastDeadline


async def within(program: Awaitable[Any], deadline_s: float) -> Any:
    """``program``'s result; past ``deadline_s`` it is cancelled and ``PastDeadline`` raised. A
    ``TimeoutError`` the program raises itself (its own ``wait_for`` around a tool, a socket's) is
    its own error and passes through as it is: ``asyncio.wait_for`` would raise the same type for
    both, and the episode would end env_deadline for the program's bug."""
    task = asyncio.ensure_future(program)
    try:
        done, _ = await asyncio.wait({task}, timeout=deadline_s)
    except asyncio.CancelledError:  # the episode ended: the program goes with it
        task.cancel()
        raise
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # its own cleanup runs, as wait_for lets it
        raise PastDeadline(f"the agent program ran past rollout.agent_deadline_s {deadline_s:g}")
    return task.result()


def episode_client(client, key: str):
    """A copy of ``client`` with the episode's ``key``. The SDK's copies do not keep what it learned
    of the platform for its headers (``_platform``), so each copy's first call would look it up
    again in a thread (``asyncify(get_platform)``): a hand-over to a thread pool and back per
    episode, 0.09 ms alone and, with the engine's loop holding the interpreter, a wait for it twice
    over. The copy is given the client's; an SDK without either is left to do as it does."""
    own = client.with_options(api_key=key)
    if getattr(own, "_platform", False) is None:
        try:
            from openai._base_client import get_platform
        except ImportError:
            return own
        own._platform = client._platform = client._platform or get_platform()
    return own
