"""What a door's exchanges sent and how long they took: :class:`StepStats`, the totals a door
reports per step (``door.stats``, ``on_step``), added up from each exchange's
:class:`~.driver.ExchangeStats` by the door's runtime (:mod:`.runtime`)."""
from __future__ import annotations

from dataclasses import dataclass, field

_MB = 1e6


@dataclass
class StepStats:
    """Totals over the exchanges of one step (or since the last :meth:`reset`).

    Attributes:
        bytes_sent: bytes this rank handed to collectives (payloads, length frames, norms,
            and uncompressed tensors), except those to the ranks of its own host in a
            hierarchical exchange.
        bytes_local: bytes this rank handed to the ranks of its own host (a hierarchical
            exchange's float32 shards: they never cross the network between hosts).
        bytes_raw: bytes the same tensors take in float32.
        encode_s, exchange_s, decode_s: seconds spent encoding, waiting for collectives, and
            decoding/aggregating on this rank.
        tensors: tensors (or fused buckets) exchanged.
        plans: how many exchange pieces took each plan (``"allgather"``, ``"sra"``, ``"sum"``,
            ``"custom"``, ``"hierarchical-<one of those>"``).
        baseline: the uncompressed allreduce the fallback compares the codecs with and moves
            buckets to, and its plan (``"fp16 (Horovod ring allreduce)"``); empty before the
            trial chose it, and without a fallback.
        fallen_back: what the baseline carried (the fallback's, and the step check's): tensors
            in ``hq.DistributedOptimizer``, buckets in the DDP hook.
    """

    bytes_sent: int = 0
    bytes_local: int = 0
    bytes_raw: int = 0
    encode_s: float = 0.0
    exchange_s: float = 0.0
    decode_s: float = 0.0
    tensors: int = 0
    plans: dict = field(default_factory=dict)
    baseline: str = ""
    fallen_back: int = 0

    @property
    def compression_ratio(self) -> float:
        """float32 bytes over bytes sent (inf when nothing was sent)."""
        return self.bytes_raw / self.bytes_sent if self.bytes_sent else float("inf")

    def add(self, exchange_stats) -> None:
        """Add one exchange's :class:`~horovod_quant.exchange.ExchangeStats`."""
        self.bytes_sent += exchange_stats.bytes_sent
        self.bytes_local += exchange_stats.bytes_local
        self.bytes_raw += exchange_stats.bytes_raw
        for kind, count in exchange_stats.plans.items():
            self.plans[kind] = self.plans.get(kind, 0) + count
        self.encode_s += exchange_stats.encode_s
        self.exchange_s += exchange_stats.exchange_s
        self.decode_s += exchange_stats.decode_s
        self.tensors += 1

    def __str__(self) -> str:
        """One line: ``sent 12.1 MB of 48.2 MB (3.98x, 36.1 MB saved) in 12 tensors; encode
        4.1 ms, exchange 30.2 ms, decode 2.0 ms``."""
        saved = self.bytes_raw - self.bytes_sent
        plans = ", ".join(f"{k} x{v}" for k, v in sorted(self.plans.items()))
        return (f"sent {self.bytes_sent / _MB:.1f} MB of {self.bytes_raw / _MB:.1f} MB "
                f"({self.compression_ratio:.2f}x, {saved / _MB:.1f} MB saved) in {self.tensors} "
                f"tensors; encode {self.encode_s * 1e3:.1f} ms, exchange "
                f"{self.exchange_s * 1e3:.1f} ms, decode {self.decode_s * 1e3:.1f} ms"
                + (f"; {self.bytes_local / _MB:.1f} MB inside the host" if self.bytes_local
                   else "") + (f"; plans: {plans}" if plans else "")
                + (f"; {self.fallen_back} on the baseline, {self.baseline}"
                   if self.baseline else ""))

    def __iadd__(self, other: "StepStats") -> "StepStats":
        for k in self.__dataclass_fields__:
            if k not in ("plans", "baseline"):
                setattr(self, k, getattr(self, k) + getattr(other, k))
        self.baseline = other.baseline or self.baseline
        for kind, count in other.plans.items():
            self.plans[kind] = self.plans.get(kind, 0) + count
        return self

    def add_raw(self, nbytes: int, raw: int | None = None) -> None:
        """Count a tensor that Horovod's own allreduce carried: ``nbytes`` sent, ``raw`` its
        float32 size (default ``nbytes``: uncompressed)."""
        self.bytes_sent += nbytes
        self.bytes_raw += nbytes if raw is None else raw
        self.tensors += 1

    def reset(self) -> "StepStats":
        """Return a copy of the totals and zero them."""
        snapshot = StepStats(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        for k, f in self.__dataclass_fields__.items():
            setattr(self, k, {} if k == "plans" else f.default)
        return snapshot
