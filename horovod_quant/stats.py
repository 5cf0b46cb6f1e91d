"""Per-step communication statistics a user can read (nothing is printed by default)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    """Totals over the exchanges of one step (or since the last :meth:`reset`).

    Attributes:
        bytes_sent: bytes this rank handed to collectives (payloads, length frames, norms,
            and uncompressed tensors).
        bytes_raw: bytes the same tensors take in float32.
        encode_s, exchange_s, decode_s: seconds spent encoding, waiting for collectives, and
            decoding/aggregating on this rank.
        tensors: tensors (or fused buckets) exchanged.
    """

    bytes_sent: int = 0
    bytes_raw: int = 0
    encode_s: float = 0.0
    exchange_s: float = 0.0
    decode_s: float = 0.0
    tensors: int = 0

    @property
    def compression_ratio(self) -> float:
        """float32 bytes over bytes sent (inf when nothing was sent)."""
        return self.bytes_raw / self.bytes_sent if self.bytes_sent else float("inf")

    def add(self, exchange_stats) -> None:
        """Add one exchange's :class:`~horovod_quant.comm.ExchangeStats`."""
        self.bytes_sent += exchange_stats.bytes_sent
        self.bytes_raw += exchange_stats.bytes_raw
        self.encode_s += exchange_stats.encode_s
        self.exchange_s += exchange_stats.exchange_s
        self.decode_s += exchange_stats.decode_s
        self.tensors += 1

    def add_raw(self, nbytes: int) -> None:
        """Count a tensor that travelled uncompressed."""
        self.bytes_sent += nbytes
        self.bytes_raw += nbytes
        self.tensors += 1

    def reset(self) -> "StepStats":
        """Return a copy of the totals and zero them."""
        snapshot = StepStats(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        for k, f in self.__dataclass_fields__.items():
            setattr(self, k, f.default)
        return snapshot
