"""The fallback controller: the user's best uncompressed allreduce carries the buckets whose
codec does not pay.

What a user would run without a codec is a tuned allreduce: float32, or a 16-bit one (Horovod's
``Compression.fp16``, DDP's bf16 hook). The door's ``baseline`` names it (:data:`BASELINES`;
"auto": the faster of float32 and the door's 16-bit allreduce, ties to float32). A door decides
once, in stages (measurements: docs/dev/benchmarks.md, "The fallback's thresholds"):

1. The baseline trial (end of step :data:`FALLBACK_STEP`): each bucket's candidate baselines
   timed alone (:func:`measure_baselines`); the door fits its links' rates to those timings
   and chooses its plans again (:func:`measured_fabric`).
2. The bucket trial: each bucket's codec exchange against the baseline's allreduce of the same
   vector, alternating; a bucket whose codec was slower leaves it (:func:`measure_and_decide`).
3. The step check, where a kept codec won narrowly (:data:`FALLBACK_CLEAR_WIN`): steps
   alternate between the trial's layout and the baseline carrying every bucket
   (:class:`StepChecker`); when the baseline's were faster, every bucket falls back.

Tests force an outcome by replacing :func:`measure_bucket` and :func:`clock` (looked up at call
time).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np

from .core.base import check_choice
from .core.baselines import BASELINE_CODECS, HOROVOD_SIXTEEN_BIT, baseline_element_bytes
from .exchange.collectives import Collectives
from .exchange.cost import Fabric, fitted_fabric, ring_allreduce
from .exchange.topology import Topology

log = logging.getLogger("horovod_quant")

#: values of a door's ``fallback`` argument: "auto" measures and decides, "never" always
#: keeps the codec
FALLBACK_MODES = ("auto", "never")

#: values of a door's ``baseline`` argument: the uncompressed allreduce a codec must beat and
#: a fallen-back bucket takes; "auto" times float32 and the door's 16-bit format and keeps the
#: faster (ties to float32, the exact one)
BASELINES = ("auto", *BASELINE_CODECS)

#: the step (counted from 0) at whose end the buckets are measured: step 0 compiles kernels,
#: allocates buffers and fills Horovod's response cache, which would count against whichever
#: trial ran first
FALLBACK_STEP = 1

#: blocking runs of each side per trial at least, alternating codec and float32 so that a
#: burst of load hits both; the median of each counts
FALLBACK_TRIALS = 3

#: ... and at most: a trial keeps adding pairs of runs until the slowest rank has spent
#: :data:`FALLBACK_TRIAL_SECONDS` on it, so a bucket of short runs is decided from many and a
#: large one on a slow link from three (run times: docs/dev/benchmarks.md)
FALLBACK_MAX_TRIALS = 15

#: the time budget of one bucket's trial (both sides), see :data:`FALLBACK_MAX_TRIALS`: the
#: one-off cost of the trial is about this per bucket, or three pairs of runs where those take
#: longer
FALLBACK_TRIAL_SECONDS = 2.0

#: a bucket falls back unless its codec exchange took at most this times the float32 allreduce
#: (and the step check's steps likewise): smaller differences are within the noise of runs on
#: shared cores (docs/performance.md) and the float32 allreduce is exact
FALLBACK_MARGIN = 0.95

#: ... and the codec must save at least this many seconds per exchange: single runs on shared
#: cores scatter by about a scheduler wake-up, so a smaller saving is not measurable and the
#: exact allreduce keeps the bucket (docs/dev/benchmarks.md)
FALLBACK_MIN_SAVING_S = 0.002

#: a kept bucket whose codec exchange took at most this share of the float32 allreduce's time
#: keeps its codec without the step check (the largest in-step loss against an isolated win
#: measured: docs/dev/benchmarks.md)
FALLBACK_CLEAR_WIN = 0.5

#: the step check runs this many steps of each layout, alternating (codec first); the median
#: of each counts, so neither a one-off cost (a layout's first step, a slow batch) nor one
#: lucky step decides
STEP_CHECK_ROUNDS = 5


def clock() -> float:
    """Seconds of a monotonic clock: what the step check times exchanges with."""
    return time.perf_counter()


def check_fallback(mode: Any) -> str:
    """``mode`` if it is one of :data:`FALLBACK_MODES`, else ValueError naming them."""
    return check_choice("fallback", mode, FALLBACK_MODES)


def check_baseline(baseline: Any) -> str:
    """``baseline`` if it is one of :data:`BASELINES`, else ValueError naming them."""
    return check_choice("baseline", baseline, BASELINES)


def baseline_candidates(baseline: str, sixteen_bit: str) -> tuple[str, ...]:
    """The baselines a trial times: both float32 and the door's ``sixteen_bit`` format for
    "auto", else ``baseline`` alone."""
    return ("fp32", sixteen_bit) if check_baseline(baseline) == "auto" else (baseline,)


@dataclass(frozen=True)
class BucketTrial:
    """What a door hands the trial about one bucket.

    Attributes:
        bucket: the bucket's index.
        codec: how the log names the bucket's codec.
        nbytes: the bucket's float32 size in bytes.
        run_codec: runs the bucket's codec exchange once, blocking until its mean is ready.
        baselines: each candidate baseline's allreduce of the same vector (name -> one
            blocking run), in :func:`baseline_candidates`' order.
        run_local: runs the float32 allreduce of the same vector among the ranks of this
            rank's host once, blocking (what the rate inside a host is measured by); None
            where the door has no host groups.
    """

    bucket: int
    codec: str
    nbytes: int
    run_codec: Callable[[], Any]
    baselines: Mapping[str, Callable[[], Any]]
    run_local: Callable[[], Any] | None = None

    def run(self, side: str) -> Callable[[], Any]:
        """The run of one side: "codec", "local", or a baseline's name."""
        if side == "codec":
            return self.run_codec
        if side == "local" and self.run_local is not None:
            return self.run_local
        return self.baselines[side]


@dataclass(frozen=True)
class BaselineChoice:
    """The baseline trial's outcome (the same on every rank).

    Attributes:
        baseline: the baseline the buckets are compared with and fall back to.
        plan: how the door's allreduce runs it, in words (the log's and the stats').
        seconds: each candidate's seconds summed over the buckets (slowest rank's medians).
        bucket_seconds: per bucket, each candidate's seconds.
        local_seconds: per bucket, the float32 allreduce inside a host (empty without host
            groups).
        fabric: the links' rates the door fitted to these timings, in words ("" when the door
            fits none).
    """

    baseline: str
    plan: str
    seconds: dict
    bucket_seconds: list
    local_seconds: list = dataclasses.field(default_factory=list)
    fabric: str = ""

    def message(self) -> str:
        """The log line of the choice."""
        times = ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in self.seconds.items())
        rates = f"; links measured: {self.fabric}" if self.fabric else ""
        return (f"horovod_quant: baseline {self.baseline} ({self.plan}): the buckets' "
                f"uncompressed allreduces took {times}{rates}")


def measured_fabric(choice: BaselineChoice, fabric: Fabric, topology: Topology,
                    numels: Sequence[int], fixed: Collection[str] = ()) -> Fabric:
    """The links' rates fitted to the baseline trial's timings (:func:`.cost.fitted_fabric`):
    each bucket's float32 allreduce (else its 16-bit one: a 16-bit sum adds CPU work of its own
    on CPU ranks) as a ring allreduce over ``topology`` (its ``numels``), its float32 allreduce
    inside a host as a ring over one host's ranks; the fields in ``fixed`` (those the door's
    environment sets: ``doors.DoorEnvironment.fabric_set``) kept as in ``fabric``."""
    first = choice.bucket_seconds[0]
    timed = ["fp32"] if "fp32" in first else list(first)
    across = [(ring_allreduce(topology, numel, baseline_element_bytes(name)), times[name])
              for numel, times in zip(numels, choice.bucket_seconds) for name in timed]
    one_host = Topology.grid(1, topology.local_size)
    inside = [(ring_allreduce(one_host, numel, 4), seconds)
              for numel, seconds in zip(numels, choice.local_seconds)]
    return fitted_fabric(fabric, across, inside, fixed)


def ranks(count: int) -> str:
    """``"1 rank"``, ``"2 ranks"``: a baseline's plan in words."""
    return f"{count} rank{'s' if count != 1 else ''}"


def choose_baseline(seconds: Mapping[str, float]) -> str:
    """The faster of the timed baselines; float32 wins a tie (and any candidate left alone)."""
    best = "fp32" if "fp32" in seconds else next(iter(seconds))
    for name, s in seconds.items():
        if s < seconds[best]:
            best = name
    return best


@dataclass(frozen=True)
class FallbackDecision:
    """One bucket's measurement and what was decided from it (the same on every rank).

    Attributes:
        bucket: the bucket's index when it was measured.
        codec: the bucket's codec, as the log names it.
        nbytes: the bucket's float32 size in bytes.
        codec_s: seconds of the codec exchange (slowest rank's median run).
        baseline_s: seconds of the baseline's allreduce (slowest rank's median run).
        step: the step it was measured at.
        fallback: True when the baseline's allreduce carries the bucket's tensors from the
            next step on.
        baseline: the baseline it was compared with (:data:`BASELINES`).
        margin: the rule's margin (:data:`FALLBACK_MARGIN`).
        min_saving_s: the rule's least saving (:data:`FALLBACK_MIN_SAVING_S`).
    """

    bucket: int
    codec: str
    nbytes: int
    codec_s: float
    baseline_s: float
    step: int
    fallback: bool
    baseline: str = "fp32"
    margin: float = FALLBACK_MARGIN
    min_saving_s: float = FALLBACK_MIN_SAVING_S

    def message(self) -> str:
        """The log line of a fallback (or of a kept codec)."""
        return (f"horovod_quant: bucket {self.bucket} ({self.codec}, {self.nbytes / 1e6:.1f} MB): "
                f"codec exchange {self.codec_s * 1e3:.1f} ms, {self.baseline} allreduce "
                f"{self.baseline_s * 1e3:.1f} ms (measured at step {self.step}): "
                + _verdict(self.fallback, self.margin, "it", self.min_saving_s, self.baseline))


def _falls_back(codec_s: float, baseline_s: float, margin: float = FALLBACK_MARGIN,
               min_saving_s: float = 0.0) -> bool:
    """The rule of the trial and of the step check: the baseline wins unless the codec took
    at most ``margin`` times its time and, when ``min_saving_s`` is set (> 0), saved at least
    that many seconds."""
    return bool(codec_s > margin * baseline_s
                or (min_saving_s > 0 and baseline_s - codec_s < min_saving_s))


def _verdict(fallback: bool, margin: float, what: str, min_saving_s: float = 0.0,
             baseline: str = "fp32") -> str:
    if fallback:
        least = f" and {min_saving_s * 1e3:g} ms" if min_saving_s else ""
        return (f"the codec does not save {(1 - margin) * 100:.0f}%{least}; the {baseline} "
                f"allreduce carries {what} from now on")
    return f"the codec keeps {what}"


def measure_bucket(trial: BucketTrial, sides: Sequence[str],
                   sync: Callable[[float], float] | None = None,
                   min_runs: int = FALLBACK_TRIALS, max_runs: int = FALLBACK_MAX_TRIALS,
                   budget_s: float = FALLBACK_TRIAL_SECONDS) -> list[float]:
    """This rank's median seconds of each of ``trial``'s ``sides`` (:meth:`BucketTrial.run`:
    its codec exchange, its baselines' allreduces, the allreduce inside the host): blocking
    runs taken in turn, the first side's first; ``min_runs`` rounds, then more while the trial
    has taken less than ``budget_s`` (on the slowest rank), up to ``max_runs``. Every rank must
    call it for the same buckets in the same order (the runs are collectives).

    Args:
        trial: the bucket.
        sides: the runs compared, in order.
        sync: called, untimed, before each run with this rank's seconds spent so far; returns
            the largest over the ranks. A barrier: without it a run's time includes waiting for
            a peer still finishing the run before (a codec run returns on each rank once its
            own decode is done), which charges one side with the other's cost. Its answer,
            the same on every rank, decides whether another round runs, so every rank runs as
            many. None (one process): no barrier, this rank's own seconds.
        min_runs: rounds at least.
        max_runs: rounds at most.
        budget_s: seconds after which no further round starts (beyond ``min_runs``).
    """
    runs = [trial.run(side) for side in sides]
    times: list[list[float]] = [[] for _ in runs]
    spent = 0.0

    def barrier() -> float:
        return spent if sync is None else sync(spent)

    for run in range(max_runs):
        # the barrier before a round's first run comes first: every rank calls it, round or not
        if barrier() >= budget_s and run >= min_runs:
            break
        for side, fn in enumerate(runs):
            if side:
                barrier()
            start = time.perf_counter()
            fn()
            times[side].append(time.perf_counter() - start)
            spent += times[side][-1]
    return [float(np.median(t)) for t in times]


def decide(trials: Sequence[BucketTrial], seconds: np.ndarray, step: int,
           baseline: str = "fp32", margin: float = FALLBACK_MARGIN,
           min_saving_s: float = FALLBACK_MIN_SAVING_S) -> list[FallbackDecision]:
    """The rule: a bucket falls back when its codec exchange took longer than ``margin`` times
    the baseline's allreduce (it does not save ``1 - margin`` of the time) or saved less than
    ``min_saving_s`` (:func:`_falls_back`).

    Args:
        trials: the measured buckets.
        seconds: one row (codec seconds, baseline seconds) per bucket, agreed by every rank.
        step: the step they were measured at.
        baseline: the baseline's name.
        margin: see :data:`FALLBACK_MARGIN`.
        min_saving_s: see :data:`FALLBACK_MIN_SAVING_S`.

    Returns:
        One decision per bucket, in order.
    """
    return [FallbackDecision(t.bucket, t.codec, t.nbytes, float(codec_s), float(baseline_s),
                             step, _falls_back(codec_s, baseline_s, margin, min_saving_s),
                             baseline, margin, min_saving_s)
            for t, (codec_s, baseline_s) in zip(trials, seconds)]


def _agreed_medians(comm: Collectives, name: str, trials: Sequence[BucketTrial],
                    sides: Sequence[str]) -> np.ndarray:
    """Every trial's ``sides`` measured on this rank (:func:`measure_bucket`, a barrier before
    each run), then the elementwise maximum over the ranks (one allreduce): the rows every rank
    decides from. Each rank's timings differ (its own encode and decode, when it entered a
    collective); the maximum is what a step waits for, the slowest rank. Collective."""
    barriers = itertools.count()

    def barrier(spent: float) -> float:
        return float(np.asarray(comm.allreduce_async(
            np.array([spent], np.float64), f"{name}.sync{next(barriers)}", "max").wait())[0])

    local = np.array([measure_bucket(t, sides, sync=barrier) for t in trials],
                     dtype=np.float64)
    return np.asarray(comm.allreduce_async(local, name, "max").wait()).reshape(local.shape)


def measure_baselines(comm: Collectives, trials: Sequence[BucketTrial], name: str,
                      plan: str) -> BaselineChoice:
    """The baseline trial: every bucket's candidate baselines (and its allreduce inside a
    host, where the door gives one) timed in turn, agreed over the ranks, the faster
    candidate over all buckets kept (:func:`choose_baseline`). Collective: every rank calls it
    at the same point with the same buckets.

    Args:
        comm: the collectives of the ranks.
        trials: the buckets, in the same order on every rank (non-empty).
        name: collective name of the agreement.
        plan: how the door's allreduce runs a baseline, in words.
    """
    names = list(trials[0].baselines)
    local = trials[0].run_local is not None
    agreed = _agreed_medians(comm, name, trials, names + (["local"] if local else []))
    totals = {n: float(agreed[:, i].sum()) for i, n in enumerate(names)}
    return BaselineChoice(choose_baseline(totals), plan, totals,
                          [dict(zip(names, map(float, row[:len(names)]))) for row in agreed],
                          [float(row[-1]) for row in agreed] if local else [])


def measure_and_decide(comm: Collectives, trials: Sequence[BucketTrial], step: int,
                       name: str, baseline: str = "fp32") -> list[FallbackDecision]:
    """Measure every bucket's codec exchange against ``baseline``'s allreduce on this rank
    (alternating), agree on the numbers, decide. Collective: every rank calls it at the same
    point with the same buckets; every rank decides from the same numbers, hence identically,
    which keeps the weights identical.

    Args:
        comm: the collectives of the ranks.
        trials: the buckets, in the same order on every rank.
        step: the step being measured (for the records).
        name: collective name of the agreement.
        baseline: the baseline the codecs are compared with (one of each trial's baselines).

    Returns:
        One decision per bucket, the same on every rank.
    """
    if not trials:
        return []
    agreed = _agreed_medians(comm, name, trials, ["codec", baseline])
    return decide(trials, agreed, step, baseline)


def needs_step_check(decisions: Sequence[FallbackDecision],
                     clear_win: float = FALLBACK_CLEAR_WIN) -> bool:
    """Whether a kept bucket won its isolated trial by too little to skip the step check: its
    codec exchange took more than ``clear_win`` times the baseline's allreduce."""
    return any(not d.fallback and d.codec_s > clear_win * d.baseline_s for d in decisions)


@dataclass(frozen=True)
class StepCheck:
    """The step check's measurement and decision (the same on every rank).

    Attributes:
        first_step: the first step of the check.
        codec_step_s: seconds of the median step's exchange with the kept codecs (the rank
            that started it last, :meth:`StepChecker.decide`).
        baseline_step_s: the same with the baseline's allreduce carrying every bucket.
        steps: steps of each layout.
        fallback: True when the baseline carries every bucket from the next step on.
        baseline: the baseline (:data:`BASELINES`).
        margin: the rule's margin (:data:`FALLBACK_MARGIN`).
    """

    first_step: int
    codec_step_s: float
    baseline_step_s: float
    steps: int
    fallback: bool
    baseline: str = "fp32"
    margin: float = FALLBACK_MARGIN

    def message(self) -> str:
        """The log line of the decision."""
        return (f"horovod_quant: the exchanges of training steps took "
                f"{self.codec_step_s * 1e3:.1f} ms with the codec, "
                f"{self.baseline_step_s * 1e3:.1f} ms with the {self.baseline} allreduce "
                f"(median of each, steps {self.first_step}-"
                f"{self.first_step + 2 * self.steps - 1}): "
                + _verdict(self.fallback, self.margin, "every bucket" if self.fallback
                           else "its buckets", baseline=self.baseline))


class StepChecker:
    """The step check in progress: which layout each of its steps runs, and the times of their
    exchanges.

    A door creates it at the end of the trial's step with the two layouts (whatever the door
    names a layout by: here the set of tensors the baseline's allreduce carries), asks
    :meth:`next_layout` for the layout of each following step, brackets each step's exchange
    with :meth:`start` (when the step's first gradient is ready to be sent: forward, data
    loading and the wait for them stay out) and :meth:`stop` (once the step's exchanges have
    all finished on this rank, before anything else is done there), and calls :meth:`decide`
    once :attr:`complete`.

    Args:
        first_step: the step the check starts at.
        codec_layout: the trial's decisions (the kept codecs).
        baseline_layout: every bucket on the baseline's allreduce.
        rounds: steps of each layout.
    """

    def __init__(self, first_step: int, codec_layout: Any, baseline_layout: Any,
                 rounds: int = STEP_CHECK_ROUNDS) -> None:
        self.first_step = first_step
        self.rounds = rounds
        self.layouts = {False: codec_layout, True: baseline_layout}
        self._baseline_steps = [False, True] * rounds  # True: that step runs the baseline
        self.seconds: list[float] = []
        self._started: float | None = None

    @property
    def complete(self) -> bool:
        """Every step of the check was timed."""
        return len(self.seconds) == len(self._baseline_steps)

    def next_layout(self) -> Any:
        """The layout the next untimed step runs."""
        return self.layouts[self._baseline_steps[len(self.seconds)]]

    def start(self) -> None:
        """The step's exchange begins now; later calls before :meth:`stop` change nothing."""
        if self._started is None:
            self._started = clock()

    def stop(self) -> None:
        """The exchange begun by :meth:`start` ends now."""
        if self._started is None:
            raise RuntimeError("StepChecker.stop() without start()")
        self.seconds.append(clock() - self._started)
        self._started = None

    def state_dict(self, name_of: Callable[[Any], str]) -> dict[str, Any]:
        """The check so far, its layouts' keys named by ``name_of`` (a checkpoint)."""
        return {"first_step": self.first_step, "rounds": self.rounds,
                "layouts": [sorted(map(name_of, self.layouts[side])) for side in (False, True)],
                "seconds": list(self.seconds)}

    @classmethod
    def from_state_dict(cls, saved: Mapping[str, Any],
                        key_of: Callable[[str], Any]) -> "StepChecker":
        """The check :meth:`state_dict` saved, its layouts' names mapped back by ``key_of``."""
        codec_layout, baseline_layout = ([key_of(n) for n in names]
                                         for names in saved["layouts"])
        checker = cls(int(saved["first_step"]), frozenset(codec_layout), frozenset(baseline_layout),
                      int(saved["rounds"]))
        checker.seconds = [float(t) for t in saved["seconds"]]
        return checker

    def decide(self, comm: Collectives, name: str, baseline: str = "fp32",
               margin: float = FALLBACK_MARGIN) -> StepCheck:
        """Agree on the steps' times and decide: the baseline's layout wins unless the codec
        layout's median step took at most ``margin`` times the baseline layout's. Collective.

        A step's time is the shortest exchange over the ranks: the ranks finish an exchange
        together, so the rank that started it last (the slowest to reach backward) waited
        least for its peers and its time is the exchange's own, while another rank's time also
        holds its wait for that rank (a rank slow in every other step would otherwise be
        charged to the layout those steps run).

        Returns:
            The decision, the same on every rank; ``layouts[decision.fallback]`` is the layout
            to keep.
        """
        if not self.complete:
            raise RuntimeError(f"the step check has timed {len(self.seconds)} of "
                               f"{len(self._baseline_steps)} steps")
        # the minimum over ranks, as the maximum of the negated times
        agreed = -np.asarray(comm.allreduce_async(-np.array(self.seconds, np.float64), name,
                                                  "max").wait()).reshape(-1)
        codec_s, baseline_s = (
            float(np.median([s for s, on_baseline in zip(agreed, self._baseline_steps)
                             if on_baseline is side])) for side in (False, True))
        return StepCheck(self.first_step, codec_s, baseline_s, self.rounds,
                         _falls_back(codec_s, baseline_s, margin), baseline, margin)


class FallbackController:
    """The fallback of one door: the baseline and bucket trials at the end of step
    :data:`FALLBACK_STEP`, then the step check where a kept codec won narrowly.

    The door names its tensors by keys of its choice (the torch optimizer: ``id`` of each
    parameter) and keeps the tensors of :attr:`fallen_back` on its allreduce of
    :attr:`baseline`. It calls :meth:`exchange_started` when a step's first gradient is ready
    and :meth:`end_step` at the end of every step; :meth:`end_step` returns whether the door
    must form its buckets again (:attr:`fallen_back` changed). The decisions are the same on
    every rank.

    Args:
        mode: "auto" (measure and decide) or "never" (always the codec).
        baseline: the door's ``baseline`` setting (:data:`BASELINES`).
        sixteen_bit: the door's 16-bit allreduce, timed against float32 by "auto" ("fp16" for
            Horovod's ``Compression.fp16``, "bf16" for DDP's bf16 hook).

    Attributes:
        decisions: the :class:`FallbackDecision` of every bucket once measured, else empty.
        step_check: the :class:`StepCheck` once one ran, else None.
        choice: the baseline trial's :class:`BaselineChoice` once it ran, else None.
        fallen_back: the keys of the tensors the baseline's allreduce carries now.
    """

    def __init__(self, mode: str, baseline: str = "auto",
                 sixteen_bit: str = HOROVOD_SIXTEEN_BIT) -> None:
        self.mode = check_fallback(mode)
        self.candidates = baseline_candidates(baseline, check_baseline(sixteen_bit))
        self.decisions: list[FallbackDecision] = []
        self.step_check: StepCheck | None = None
        self.choice: BaselineChoice | None = None
        self.fallen_back: set = set()
        self._checker: StepChecker | None = None

    @property
    def baseline(self) -> str:
        """The baseline a fallen-back tensor takes: the one chosen by the trial, or the
        setting's (float32 for "auto" before the trial, when nothing has fallen back)."""
        return self.choice.baseline if self.choice is not None else self.candidates[0]

    @property
    def checking(self) -> bool:
        """Whether the step check is under way (the layout changes from step to step)."""
        return self._checker is not None

    def settled(self, step: int) -> bool:
        """Whether the layout no longer changes for the fallback's sake from ``step`` on
        (always with ``mode="never"``)."""
        return self.mode == "never" or (step > FALLBACK_STEP and self._checker is None)

    def state_dict(self, name_of: Callable[[Any], str]) -> dict[str, Any]:
        """What the controller decided and measured so far, the door's keys named by
        ``name_of`` (a checkpoint: names outlive the objects a door keys by)."""
        return {"mode": self.mode, "candidates": list(self.candidates),
                "choice": None if self.choice is None else dataclasses.asdict(self.choice),
                "decisions": [dataclasses.asdict(d) for d in self.decisions],
                "step_check": (None if self.step_check is None
                               else dataclasses.asdict(self.step_check)),
                "fallen_back": sorted(map(name_of, self.fallen_back)),
                "checker": (None if self._checker is None
                            else self._checker.state_dict(name_of))}

    def load_state_dict(self, saved: Mapping[str, Any], key_of: Callable[[str], Any]) -> None:
        """Take up where :meth:`state_dict` was saved; ``key_of`` maps a name back to the
        door's key.

        Raises:
            ValueError: the state was saved with another ``mode`` or ``baseline``, or does not
                fit this door (``key_of``'s own error for an unknown name).
        """
        if saved.get("mode") != self.mode:
            raise ValueError(f"the checkpoint's fallback state was saved with fallback="
                             f"{saved.get('mode')!r}, this optimizer has fallback="
                             f"{self.mode!r}: build it with the saved setting")
        if list(saved.get("candidates", ())) != list(self.candidates):
            raise ValueError(f"the checkpoint's fallback state compared the codecs with "
                             f"{saved.get('candidates')}, this door with "
                             f"{list(self.candidates)}: build it with the saved baseline")
        self.choice = None if saved["choice"] is None else BaselineChoice(**saved["choice"])
        self.decisions = [FallbackDecision(**d) for d in saved["decisions"]]
        self.step_check = None if saved["step_check"] is None else StepCheck(
            **saved["step_check"])
        self.fallen_back = {key_of(name) for name in saved["fallen_back"]}
        self._checker = (None if saved["checker"] is None
                         else StepChecker.from_state_dict(saved["checker"], key_of))

    def exchange_started(self) -> None:
        """A step's exchange begins now (its first gradient is ready): the step check times
        it from here; later calls in the same step change nothing."""
        if self._checker is not None:
            self._checker.start()

    def end_step(self, comm: Collectives, name: str, step: int,
                 buckets: Sequence[Collection], trials: Callable[[], list[BucketTrial]],
                 plan: str = "", on_choice: Callable[[BaselineChoice], str] | None = None
                 ) -> bool:
        """The fallback's work at the end of ``step``: the trials at :data:`FALLBACK_STEP`,
        then each step of the step check, and its decision once every step ran. Collective
        where it measures or decides.

        Args:
            comm: the collectives of the ranks (the agreement on the times).
            name: prefix of the agreements' collective names.
            step: the step that ends (counted from 0).
            buckets: the keys of each bucket's tensors, in bucket order.
            trials: builds one :class:`BucketTrial` per bucket, in the same order (called at
                the trial only).
            plan: how the door's allreduce runs a baseline, in words (the log's).
            on_choice: called with the baseline trial's outcome before the codecs are timed
                (the door fits its links' rates and chooses its plans again); returns the
                fitted rates in words, for the log.

        Returns:
            Whether :attr:`fallen_back` changed (the door forms its buckets again).
        """
        if self.mode == "never":
            return False
        checker = self._checker
        if checker is not None:
            checker.stop()
            if not checker.complete:
                self.fallen_back = set(checker.next_layout())
                return True
            self._checker = None
            self.step_check = checker.decide(comm, f"{name}.steps", self.baseline)
            self.fallen_back = set(checker.layouts[self.step_check.fallback])
            if comm.rank == 0:
                (log.warning if self.step_check.fallback else log.info)(self.step_check.message())
            return True
        if step != FALLBACK_STEP:
            return False
        built = trials()
        if not built:
            return False
        choice = measure_baselines(comm, built, f"{name}.baselines", plan)
        if on_choice is not None:
            choice = dataclasses.replace(choice, fabric=on_choice(choice))
        self.choice = choice
        if comm.rank == 0:
            log.info(choice.message())
        self.decisions = measure_and_decide(comm, built, step, name, self.baseline)
        for members, decision in zip(buckets, self.decisions):
            if decision.fallback:
                self.fallen_back.update(members)
            if comm.rank == 0:
                (log.warning if decision.fallback else log.info)(decision.message())
        relayout = any(d.fallback for d in self.decisions)
        if needs_step_check(self.decisions):
            kept = frozenset(self.fallen_back)
            everything = kept.union(*buckets)
            self._checker = StepChecker(step + 1, kept, everything)
            self.fallen_back = set(self._checker.next_layout())
        return relayout


class FallbackAttributes:
    """The fallback's settings and records as a door's attributes (``door.baseline``,
    ``door.fallback_decisions``, ...), written once for the doors that have a fallback: the
    door holds ``options`` (with the fallback's settings) and ``_fallback``, its
    :class:`FallbackController`."""

    options: Any
    _fallback: FallbackController

    @property
    def fallback(self) -> str:
        return self.options.fallback

    @property
    def baseline(self) -> str:
        return self.options.baseline

    @property
    def fallback_baseline(self) -> BaselineChoice | None:
        """The baseline trial's outcome (the baseline chosen, its plan, the candidates' times,
        the links' rates measured) once it ran, else None."""
        return self._fallback.choice

    @property
    def fallback_decisions(self) -> list[FallbackDecision]:
        """Every bucket's trial (empty before it, and with ``fallback="never"``)."""
        return self._fallback.decisions

    @property
    def fallback_step_check(self) -> StepCheck | None:
        """The step check once one ran, else None."""
        return self._fallback.step_check
