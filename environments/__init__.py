"""What answers a turn: one interface, ``Environment`` (environments/interface.py), and each kind
of environment behind it.

- interface: ``Environment``, and what it answers with (``Step``, ``Turn``, ``Restart``,
  ``TokenIds``, ``ToolError``); the errors that end an episode (``BadStep``, ``PastDeadline``)
- native: a user's environment, the run's tools and an OpenEnv server's sessions as Environments;
  ``Environments`` makes the run's kind for each episode
- threads: the threads a native environment's calls run in
- tools: tool functions, their schemas, vLLM's tool-call and reasoning parsers
- openenv: an OpenEnv server's sessions over its WebSocket
- verifiers_envs: a verifiers environment's episodes, as an agent program
- agents: agent programs, whose calls to the rollout's endpoint are an episode's turns
- endpoint: the OpenAI-compatible endpoint those calls reach
- agent_apis: the Responses and Anthropic Messages APIs on it, each call taken as a chat call
- agent_processes: agent programs in processes of their own, over ``protocol``'s messages
- program_runs: how a program runs (its client, its deadline), in a thread or a process

A user's environment imports what it answers with from here: ``from environments import Step``.
"""

from environments.interface import Environment, Restart, Step, TokenIds, Turn

__all__ = ["Environment", "Restart", "Step", "TokenIds", "Turn"]
