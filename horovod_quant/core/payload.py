"""What travels on the wire: one contiguous buffer plus the little metadata a decoder needs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Payload:
    """An encoded vector.

    Attributes:
        data: the bytes that go on the wire, one contiguous 1-D array (uint8 for packed codes,
            uint64 for Global-QSGD's summable words, float16 for the fp16 baseline, ...).
            Collectives send exactly this array.
        size: number of elements of the encoded vector.
        meta: small per-call values that every rank already knows or that travel in the
            codec's own side channel (never large arrays), e.g. the number of summed workers.
    """

    data: np.ndarray
    size: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes this payload puts on the wire."""
        return int(self.data.nbytes)
