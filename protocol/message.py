"""A decoded message: its type, its checked fields and tensors. The codec builds it; the sample
packing and every role's handlers read it. Its own module so that the schema (which the codec
checks against) and the samples (which the schema declares) can name it without a circle."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Message:
    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    id: int = -1
    key: str = ""  # with CURVE, the name of the client key it came with (set by the receiving server)
