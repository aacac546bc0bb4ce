"""The OpenAI client an agent program's episode is given: a copy of one kept client, with the
episode's key (the rollout's program threads and a program process's event loop alike)."""

from __future__ import annotations


def episode_client(client, key: str):
    """A copy of ``client`` with the episode's ``key``. The SDK's copies do not keep what it learned
    of the platform for its headers (``_platform``), so each copy's first call would look it up
    again in a thread (``asyncify(get_platform)``): a hand-over to a thread pool and back per
    episode, 0.09 ms alone and, with the engine's loop holding the interpreter, a wait for it twice
    over. The copy is given the client's."""
    from openai._base_client import get_platform

    own = client.with_options(api_key=key)
    if getattr(own, "_platform", False) is None:  # an SDK without the field is left as it is
        own._platform = client._platform = client._platform or get_platform()
    return own
