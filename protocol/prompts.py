"""The run's prompt stream: which prompt of the data set each position of the stream holds.

The buffer owns the stream: it hands out positions (``prompt_index`` on the wire and on every
sample) with the credits, each once, so no prompt is generated twice across rollout engines,
their restarts and ``--resume``. A rollout turns a position into a row of its prompt file with
``dataset_row``: pass ``e`` over the data is a shuffle seeded by ``(seed, e)``, so the order is a
function of ``seed`` alone and every engine agrees on it without talking to another.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


@lru_cache(maxsize=4)
def _epoch_order(seed: int, size: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(size)


def dataset_row(seed: int, size: int, prompt_index: int) -> int:
    """Row of a data set of ``size`` prompts at position ``prompt_index`` of the stream."""
    if size < 1:
        raise ValueError(f"a prompt stream needs at least one prompt, got {size}")
    if prompt_index < 0:
        raise ValueError(f"prompt_index must be >= 0, got {prompt_index}")
    epoch, offset = divmod(prompt_index, size)
    return int(_epoch_order(seed, size, epoch)[offset])
