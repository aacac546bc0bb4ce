"""What several test files share: configs, samples, the buffer in a thread, running the pipeline.

Fixtures live in conftest.py; the helpers they and the tests call live here, so no test file
imports another."""

from __future__ import annotations

from typing import Any


def with_learner(config, changes: dict[str, Any]):
    """``config`` with ``learner.*`` changed: ``with_learner(config, {"advantage_estimator": "rloo"})``."""
    return config.model_copy(update={"learner": config.learner.model_copy(update=changes)})
