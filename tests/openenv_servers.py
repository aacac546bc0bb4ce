"""OpenEnv environments written with openenv's own server API, for tests/test_openenv.py: a text
environment (the sum of two numbers, one guess per turn, the reward for the right one) and an MCP
environment of one tool (add)."""

from typing import Any, Optional
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server import (Action, CallToolAction, CallToolObservation, Environment, MCPEnvironment,
                                     Observation, State, create_app)
from pydantic import Field


class Guess(Action):
    text: str = Field(..., description="the policy's turn")


class Said(Observation):
    text: str = Field(default="", description="what the environment says")


class Sums(Environment):
    """Two numbers from the reset's arguments (17 and 25 by default); each turn's text is a guess,
    the right one (or the third) ends the episode. Its turns are counted per session."""
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state, self.answer = State(episode_id=str(uuid4()), step_count=0), 42

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, a: int = 17, b: int = 25,
              **kwargs: Any) -> Said:
        self._state, self.answer = State(episode_id=episode_id or str(uuid4()), step_count=0), a + b
        return Said(text=f"What is {a} plus {b}?", done=False, reward=None)

    def step(self, action: Guess, timeout_s: Optional[float] = None, **kwargs: Any) -> Said:
        self._state.step_count += 1
        right = action.text.strip().endswith(str(self.answer))
        return Said(text="right" if right else f"turn {self._state.step_count}: no", reward=1.0 if right else 0.0,
                    done=right or self._state.step_count >= 3)

    @property
    def state(self) -> State:
        return self._state


class Calculator(MCPEnvironment):
    """Tools alone: add, and fail (which raises)."""
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("calculator")

        @mcp.tool()
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool()
        def fail(reason: str) -> str:
            """Always fails."""
            raise ValueError(reason)

        super().__init__(mcp)
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> Observation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return Observation(done=False, reward=None)

    def _step_impl(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


sums = create_app(Sums, Guess, Said, env_name="sums", max_concurrent_envs=8)
calculator = create_app(Calculator, CallToolAction, CallToolObservation, env_name="calculator",
                        max_concurrent_envs=8)
