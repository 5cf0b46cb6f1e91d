"""The fallback controller of horovod_quant.fallback: which buckets leave their codec, and that
every rank decides the same from timings that differ between ranks (no real timing here)."""
import json
import time

import numpy as np
import pytest

from horovod_quant import fallback
from horovod_quant.fallback import (
    FALLBACK_CLEAR_WIN,
    FALLBACK_MARGIN,
    FALLBACK_MIN_SAVING_S,
    FALLBACK_STEP,
    STEP_CHECK_ROUNDS,
    BucketTrial,
    FallbackController,
    StepChecker,
    check_fallback,
    decide,
    measure_and_decide,
    needs_step_check,
)

from threaded_comm import run_ranks


def _trials(count, seconds=None):
    """``count`` buckets; with ``seconds`` (codec, fp32) per bucket, runs that return them."""
    seconds = seconds or [(0.0, 0.0)] * count
    return [BucketTrial(i, "Codec(bits=8)", 4 << 20, lambda s=s: s[0], {"fp32": lambda s=s: s[1]})
            for i, s in enumerate(seconds)]


def _trial(run_codec, run_fp32):
    """One bucket whose codec and float32 runs are the given functions."""
    return BucketTrial(0, "c", 4, run_codec, {"fp32": run_fp32})


def _injected(trial, sides, **_):
    """measure_bucket for tests: the trial's runs return the seconds they stand for."""
    return [trial.run(side)() for side in sides]


@pytest.mark.parametrize("codec_s,fp32_s,falls_back", [
    (0.030, 0.040, False),  # the codec pays: kept
    (0.045, 0.039, True),  # the codec costs more than it saves: Horovod's allreduce
    (0.038, 0.040, False),  # saves exactly 5%: kept
    (0.0385, 0.040, True),  # saves less than 5%: within noise, the exact allreduce
    (0.040, 0.040, True),
    (0.0030, 0.0045, True),  # saves 33% but 1.5 ms: below what runs on shared cores resolve
    (0.0020, 0.0040, False),  # saves 2 ms: kept
])
def test_rule(codec_s, fp32_s, falls_back):
    (d,) = decide(_trials(1), np.array([[codec_s, fp32_s]]), step=1)
    assert d.fallback is falls_back
    assert (d.codec_s, d.baseline_s, d.step, d.bucket) == (codec_s, fp32_s, 1, 0)
    assert FALLBACK_MARGIN == 0.95 and FALLBACK_MIN_SAVING_S == 0.002


def test_margin_scales_the_allreduce_time():
    seconds = np.array([[0.045, 0.040]])
    assert decide(_trials(1), seconds, step=1)[0].fallback
    assert not decide(_trials(1), seconds, step=1, margin=1.2, min_saving_s=0)[0].fallback
    assert decide(_trials(1), np.array([[0.035, 0.040]]), step=1, margin=0.8)[0].fallback


def test_log_line_names_the_bucket_and_both_times():
    slow, fast = decide(_trials(2), np.array([[0.0451, 0.0392], [0.01, 0.02]]), step=1)
    assert slow.message() == (
        "horovod_quant: bucket 0 (Codec(bits=8), 4.2 MB): codec exchange 45.1 ms, fp32 "
        "allreduce 39.2 ms (measured at step 1): the codec does not save 5% and 2 ms; the "
        "fp32 allreduce carries it from now on")
    assert fast.message().endswith("(measured at step 1): the codec keeps it")


def test_ranks_decide_the_same_from_different_timings(monkeypatch):
    monkeypatch.setattr(fallback, "measure_bucket", _injected)
    # rank 0 alone would keep bucket 0 and drop bucket 1, rank 1 the opposite; the slowest
    # rank's times (codec 50 vs fp32 40, codec 30 vs fp32 35) decide for both
    per_rank = [[(0.020, 0.040), (0.030, 0.010)],
                [(0.050, 0.030), (0.010, 0.035)]]
    decisions = run_ranks(2, lambda comm: measure_and_decide(
        comm, _trials(2, per_rank[comm.rank]), step=1, name="fb"))
    assert decisions[0] == decisions[1]
    assert [d.fallback for d in decisions[0]] == [True, False]
    assert [(d.codec_s, d.baseline_s) for d in decisions[0]] == [(0.050, 0.040), (0.030, 0.035)]


def test_no_buckets_no_collective():
    assert measure_and_decide(None, [], step=1, name="fb") == []


def test_measure_bucket_takes_the_median_run():
    calls = []
    durations = iter([0.2, 0.0, 0.0])

    def run():
        calls.append(1)
        time.sleep(next(durations))

    codec_s, _ = fallback.measure_bucket(_trial(run, lambda: None), ["codec", "fp32"],
                                         min_runs=3, max_runs=3)
    assert len(calls) == 3 and codec_s < 0.1


@pytest.mark.parametrize("agreed_spent,pairs", [
    (0.0, 7),  # under budget: pairs up to max_runs
    (0.6, 3),  # over budget (on the slowest rank): min_runs pairs only
])
def test_measure_bucket_adds_pairs_while_under_budget(agreed_spent, pairs):
    order = []
    fallback.measure_bucket(_trial(lambda: order.append("codec"), lambda: order.append("fp32")),
                            ["codec", "fp32"], sync=lambda spent: agreed_spent, min_runs=3,
                            max_runs=7, budget_s=0.5)
    assert order == ["codec", "fp32"] * pairs


def test_ranks_run_as_many_pairs():
    """A rank whose runs are fast alone would run more pairs than a slow one: the runs are
    collectives, so the barrier's agreed time decides for every rank."""
    def rank(comm):
        runs = []

        def run_codec():
            runs.append(1)
            if comm.rank == 0:
                time.sleep(0.7)  # rank 0 is over the 2 s budget after 3 pairs

        trial = _trial(run_codec, lambda: comm.allreduce_async(
            np.zeros(1), f"fp32.{len(runs)}", "sum").wait())
        measure_and_decide(comm, [trial], step=1, name="fb")
        return len(runs)
    assert run_ranks(2, rank) == [fallback.FALLBACK_TRIALS] * 2
    assert fallback.FALLBACK_TRIAL_SECONDS == 2.0


@pytest.mark.parametrize("mode", ["auto", "never"])
def test_modes_accepted(mode):
    assert check_fallback(mode) == mode


@pytest.mark.parametrize("mode", ["always", "Auto", None, True])
def test_other_modes_rejected(mode):
    with pytest.raises(ValueError, match=r"fallback=.*choose one of \['auto', 'never'\]"):
        check_fallback(mode)


def test_measure_bucket_alternates_the_two_sides():
    order = []
    fallback.measure_bucket(_trial(lambda: order.append("codec"), lambda: order.append("fp32")),
                            ["codec", "fp32"], min_runs=3, max_runs=3)
    assert order == ["codec", "fp32"] * 3


@pytest.mark.parametrize("seconds,checked", [
    ([(0.030, 0.040)], True),  # kept, won by 1.33x: checked in training steps
    ([(0.020, 0.040)], False),  # won by 2x: clear
    ([(0.050, 0.040)], False),  # fell back: nothing kept to check
    ([(0.050, 0.040), (0.010, 0.040)], False),
    ([(0.010, 0.040), (0.037, 0.040)], True),  # one narrow win is enough
])
def test_step_check_only_for_narrow_wins(seconds, checked):
    decisions = decide(_trials(len(seconds)), np.array(seconds), step=1)
    assert needs_step_check(decisions) is checked
    assert FALLBACK_CLEAR_WIN == 0.5


class _FakeClock:
    """fallback.clock for tests: each step lasts the seconds given for it."""

    def __init__(self, durations):
        self.now, self.durations, self.running = 0.0, list(durations), False

    def __call__(self):
        if self.running:  # stop(): the step took its duration
            self.now += self.durations.pop(0)
        self.running = not self.running
        return self.now


def _run_check(monkeypatch, durations, rounds=3):
    monkeypatch.setattr(fallback, "clock", _FakeClock(durations))
    checker = StepChecker(2, "codec layout", "fp32 layout", rounds=rounds)
    layouts = []
    while not checker.complete:
        layouts.append(checker.next_layout())
        checker.start()
        checker.stop()
    return checker, layouts


def test_step_checker_alternates_layouts_codec_first(monkeypatch):
    checker, layouts = _run_check(monkeypatch, [0.1] * 6)
    assert layouts == ["codec layout", "fp32 layout"] * 3
    assert checker.seconds == pytest.approx([0.1] * 6)


@pytest.mark.parametrize("durations,falls_back,codec_s,fp32_s", [
    # the codec's steps are slower but for a one-off: the median of each layout decides
    ([0.9, 0.5, 0.4, 0.5, 0.45, 0.55], False, 0.45, 0.5),
    ([0.7, 0.5, 0.6, 0.9, 0.65, 0.52], True, 0.65, 0.52),
    ([0.5, 0.5, 0.5, 0.5, 0.5, 0.5], True, 0.5, 0.5),  # a tie: the exact allreduce
    ([0.475, 0.5, 0.47, 0.5, 0.46, 0.5], False, 0.47, 0.5),  # saves 5%: kept
    ([0.4, 0.5, 0.6, 0.5, 0.6, 0.5], True, 0.6, 0.5),  # one lucky codec step does not decide
])
def test_step_check_decides_on_the_median_steps(monkeypatch, durations, falls_back, codec_s,
                                                  fp32_s):
    checker, _ = _run_check(monkeypatch, durations)
    check = checker.decide(_Local(), "fb.steps")
    assert (check.fallback, check.first_step, check.steps) == (falls_back, 2, 3)
    assert (check.codec_step_s, check.baseline_step_s) == pytest.approx((codec_s, fp32_s))
    assert checker.layouts[check.fallback] == ("fp32 layout" if falls_back else "codec layout")
    assert ("the fp32 allreduce carries every bucket from now on" in check.message()) is \
        falls_back
    assert ("the codec keeps its buckets" in check.message()) is not falls_back
    assert "steps 2-7" in check.message()


class _Local:
    """One rank's collectives: the max over one rank is its own numbers."""

    rank = 0

    def allreduce_async(self, x, name, op):
        assert op == "max"

        class Done:
            def wait(self):
                return x
        return Done()


def test_step_check_ranks_agree_on_the_rank_that_started_last(monkeypatch):
    """Each step counts the shortest of the ranks' exchange times: rank 1 reached the codec
    steps late (rank 0 waited for it: 0.6 s), so its times are the exchanges' own. The slowest
    rank's times (codec 0.6, fp32 0.5) would drop the codec."""
    per_rank = [[0.6, 0.5, 0.6, 0.5, 0.6, 0.5], [0.3, 0.5, 0.3, 0.5, 0.3, 0.5]]

    def rank(comm):
        checker = StepChecker(2, "codec", "fp32", rounds=3)
        for d in per_rank[comm.rank]:
            checker.seconds.append(d)
        return checker.decide(comm, "fb.steps")
    checks = run_ranks(2, rank)
    assert checks[0] == checks[1]
    assert not checks[0].fallback
    assert (checks[0].codec_step_s, checks[0].baseline_step_s) == (0.3, 0.5)


def test_step_checker_times_from_the_first_start(monkeypatch):
    """start() marks the step's first gradient ready; later calls of the step (the other
    gradients' hooks, synchronize()) do not move it."""
    now = [0.0]
    monkeypatch.setattr(fallback, "clock", lambda: now[0])
    checker = StepChecker(2, "codec", "fp32", rounds=1)
    for start, stop in ((1.0, 1.5), (3.0, 3.2)):
        for now[0] in (start, start + 0.1, start + 0.3):
            checker.start()
        now[0] = stop
        checker.stop()
    assert checker.seconds == pytest.approx([0.5, 0.2])


def test_step_checker_misuse_is_an_error():
    checker = StepChecker(2, "a", "b", rounds=1)
    with pytest.raises(RuntimeError, match="without start"):
        checker.stop()
    with pytest.raises(RuntimeError, match="timed 0 of 2 steps"):
        checker.decide(_Local(), "x")


def test_measure_bucket_syncs_before_every_timed_run():
    events = []
    fallback.measure_bucket(_trial(lambda: events.append("codec"),
                                   lambda: events.append("fp32")), ["codec", "fp32"],
                            sync=lambda spent: events.append("sync") or spent, min_runs=2,
                            max_runs=2)
    assert events == ["sync", "codec", "sync", "fp32"] * 2


def test_measure_and_decide_syncs_through_the_collectives():
    """The barrier is a collective of the ranks: a rank that finished its codec run early
    does not start timing the float32 run while its peer still decodes."""
    def rank(comm):
        slow = comm.rank == 0

        def run_codec():
            if slow:
                time.sleep(0.05)  # rank 0's decode is slower: rank 1 waits in the barrier

        runs = iter(range(100))  # the threaded world pairs collectives by name: one per run
        trial = _trial(run_codec, lambda: comm.allreduce_async(
            np.zeros(1), f"fp32.{next(runs)}", "sum").wait())
        return measure_and_decide(comm, [trial], step=1, name="fb")[0]
    decisions = run_ranks(2, rank)
    assert decisions[0] == decisions[1]
    # without the barrier rank 1's float32 run would include rank 0's 50 ms
    assert decisions[0].baseline_s < 0.04 and decisions[0].codec_s >= 0.05


# -- the controller: the trial, then the step check, as a door drives them ------------------------
NAMES = {1: "a.weight", 2: "a.bias", 3: "b.weight"}  # a door's keys, named in checkpoints


def _drive(monkeypatch, trial_seconds, step_seconds=(), resume_at=None):
    """A door's steps through a :class:`FallbackController` (two buckets of keys {1, 2} and
    {3}): returns the controller and, per step, (relayout, fallen_back) after its end.
    ``resume_at``: before that step the controller is replaced by a new one loaded from its
    state_dict (through JSON, as a checkpoint)."""
    monkeypatch.setattr(fallback, "measure_bucket", _injected)
    monkeypatch.setattr(fallback, "clock", _FakeClock(step_seconds))
    controller = FallbackController("auto", "fp32")
    buckets = [{1, 2}, {3}]
    built = []
    history = []
    keys = {name: key for key, name in NAMES.items()}
    for step in range(FALLBACK_STEP + 1 + (2 * STEP_CHECK_ROUNDS if step_seconds else 0)):
        if step == resume_at:
            saved = json.loads(json.dumps(controller.state_dict(NAMES.__getitem__)))
            controller = FallbackController("auto", "fp32")
            controller.load_state_dict(saved, keys.__getitem__)
        controller.exchange_started()
        controller.exchange_started()  # a later hook of the step: changes nothing
        relayout = controller.end_step(_Local(), "fb", step, buckets,
                                       lambda: built.append(step) or _trials(2, trial_seconds))
        history.append((relayout, set(controller.fallen_back)))
    assert built == [FALLBACK_STEP]  # the trials are built once, at the trial's step
    return controller, history


def test_controller_trial_moves_the_slow_buckets(monkeypatch):
    controller, history = _drive(monkeypatch, [(0.050, 0.040), (0.010, 0.040)])
    assert history == [(False, set()), (True, {1, 2})]
    assert [d.fallback for d in controller.decisions] == [True, False]
    assert controller.step_check is None and not controller.checking
    assert controller.settled(FALLBACK_STEP + 1) and not controller.settled(FALLBACK_STEP)


def test_controller_step_check_alternates_then_decides(monkeypatch):
    codec_steps, fp32_steps = [0.6] * STEP_CHECK_ROUNDS, [0.5] * STEP_CHECK_ROUNDS
    steps = [s for pair in zip(codec_steps, fp32_steps) for s in pair]
    controller, history = _drive(monkeypatch, [(0.035, 0.040), (0.010, 0.040)], steps)
    after_trial = history[FALLBACK_STEP]
    assert after_trial == (False, set())  # kept both, the check's first step runs the codec
    layouts = [fallen for _, fallen in history[FALLBACK_STEP + 1:-1]]
    assert layouts == [{1, 2, 3}, set()] * (STEP_CHECK_ROUNDS - 1) + [{1, 2, 3}]
    assert controller.step_check.fallback and history[-1] == (True, {1, 2, 3})
    assert not controller.checking


@pytest.mark.parametrize("resume_at", [FALLBACK_STEP + 1, FALLBACK_STEP + 4])
def test_controller_resumes_from_its_state_dict(monkeypatch, resume_at):
    """Saved after the trial or in the middle of the step check and loaded into a new
    controller, it takes the same layouts and decisions as the one that ran on."""
    steps = [0.6, 0.5] * STEP_CHECK_ROUNDS
    trials = [(0.035, 0.040), (0.010, 0.040)]
    straight, want = _drive(monkeypatch, trials, steps)
    resumed, got = _drive(monkeypatch, trials, steps, resume_at=resume_at)
    assert got == want
    assert resumed.decisions == straight.decisions
    assert resumed.step_check == straight.step_check and resumed.step_check is not None
    with pytest.raises(ValueError, match="fallback='never'"):
        FallbackController("auto").load_state_dict(
            FallbackController("never").state_dict(str), int)


def test_controller_never_measures(monkeypatch):
    monkeypatch.setattr(fallback, "measure_bucket", lambda *a, **k: pytest.fail("measured"))
    controller = FallbackController("never")
    for step in range(4):
        assert controller.end_step(None, "fb", step, [{1}], lambda: pytest.fail("trials")) is False
    assert controller.settled(0) and controller.decisions == [] and controller.fallen_back == set()
    with pytest.raises(ValueError, match="fallback='sometimes'"):
        FallbackController("sometimes")


# -- the baseline: the user's best uncompressed allreduce ----------------------------------------
@pytest.mark.parametrize("seconds,chosen", [
    ({"fp32": 0.040, "fp16": 0.025}, "fp16"),  # the 16-bit allreduce is faster
    ({"fp32": 0.030, "fp16": 0.045}, "fp32"),  # gloo's 16-bit sum on CPU ranks can lose
    ({"fp32": 0.030, "fp16": 0.030}, "fp32"),  # a tie: the exact one
    ({"fp32": 0.030, "bf16": 0.0299}, "bf16"),
    ({"bf16": 0.5}, "bf16"),  # a fixed baseline, timed alone
])
def test_auto_picks_the_faster_baseline_ties_to_float32(seconds, chosen):
    assert fallback.choose_baseline(seconds) == chosen


@pytest.mark.parametrize("baseline,sixteen,candidates", [
    ("auto", "fp16", ("fp32", "fp16")), ("auto", "bf16", ("fp32", "bf16")),
    ("fp32", "fp16", ("fp32",)), ("fp16", "bf16", ("fp16",)), ("bf16", "fp16", ("bf16",)),
])
def test_baseline_candidates(baseline, sixteen, candidates):
    assert fallback.baseline_candidates(baseline, sixteen) == candidates
    assert FallbackController("auto", baseline, sixteen).candidates == candidates


@pytest.mark.parametrize("bad", ["float16", "FP16", None, 16, "none"])
def test_other_baselines_rejected(bad):
    with pytest.raises(ValueError, match=r"baseline=.*choose one of \['auto', 'fp32', 'fp16', "
                                         r"'bf16'\]"):
        fallback.check_baseline(bad)


def _baseline_trials(per_bucket):
    """Buckets whose runs return the seconds given: (codec, {baseline: seconds}, local)."""
    return [BucketTrial(i, "Codec(bits=8)", 4 << 20, lambda c=c: c,
                        {name: (lambda t=t: t) for name, t in times.items()},
                        None if local is None else (lambda v=local: v))
            for i, (c, times, local) in enumerate(per_bucket)]


def _drive_baseline(monkeypatch, baseline, per_bucket, on_choice=None):
    monkeypatch.setattr(fallback, "measure_bucket", _injected)
    controller = FallbackController("auto", baseline, "fp16")
    built = [t for t in _baseline_trials(per_bucket)
             if set(t.baselines) == set(controller.candidates)]
    assert len(built) == len(per_bucket)
    controller.end_step(_Local(), "fb", FALLBACK_STEP, [{1, 2}, {3}], lambda: built,
                        "Horovod's ring allreduce, 2 ranks", on_choice)
    return controller


@pytest.mark.parametrize("baseline,codec_kept", [
    # bucket 0's codec (30 ms) beats float32 (40 ms) but not fp16 (20 ms); bucket 1's beats both
    ("fp32", [True, True]), ("fp16", [False, True]), ("auto", [False, True]),
])
def test_buckets_are_compared_with_the_chosen_baseline(monkeypatch, baseline, codec_kept):
    times = [(0.030, {"fp32": 0.040, "fp16": 0.020}, None),
             (0.004, {"fp32": 0.040, "fp16": 0.021}, None)]
    per_bucket = [(c, {k: v for k, v in t.items() if k in fallback.baseline_candidates(
        baseline, "fp16")}, local) for c, t, local in times]
    controller = _drive_baseline(monkeypatch, baseline, per_bucket)
    want = "fp32" if baseline == "fp32" else "fp16"
    assert controller.baseline == want == controller.choice.baseline
    assert [not d.fallback for d in controller.decisions] == codec_kept
    assert [d.baseline_s for d in controller.decisions] == [t[want] for _, t, _ in times]
    assert {d.baseline for d in controller.decisions} == {want}
    assert controller.fallen_back == ({1, 2} if not codec_kept[0] else set())
    assert controller.choice.message().startswith(
        f"horovod_quant: baseline {want} (Horovod's ring allreduce, 2 ranks): the buckets' "
        f"uncompressed allreduces took {'fp16' if baseline == 'fp16' else 'fp32'} ")


def test_the_door_fits_its_links_before_the_codecs_are_timed(monkeypatch):
    order = []

    def on_choice(choice):
        order.append(("choice", choice.bucket_seconds, choice.local_seconds))
        return "3 Gbit/s between hosts"

    monkeypatch.setattr(fallback, "measure_bucket", lambda trial, sides, **_: order.append(
        list(sides)) or [trial.run(side)() for side in sides])
    controller = FallbackController("auto", "auto", "fp16")
    trials = _baseline_trials([(0.01, {"fp32": 0.04, "fp16": 0.03}, 0.002)])
    controller.end_step(_Local(), "fb", FALLBACK_STEP, [{1}], lambda: trials, "ring", on_choice)
    # three runs (both baselines, the local allreduce), the fit, then codec against fp16
    assert order == [["fp32", "fp16", "local"],
                     ("choice", [{"fp32": 0.04, "fp16": 0.03}], [0.002]), ["codec", "fp16"]]
    assert controller.choice.fabric == "3 Gbit/s between hosts"
    assert "links measured: 3 Gbit/s between hosts" in controller.choice.message()


def test_the_baseline_choice_survives_a_checkpoint(monkeypatch):
    times = [(0.030, {"fp32": 0.040, "fp16": 0.020}, None), (0.004, {"fp32": 0.04,
                                                                     "fp16": 0.021}, None)]
    controller = _drive_baseline(monkeypatch, "auto", times)
    saved = json.loads(json.dumps(controller.state_dict(NAMES.__getitem__)))
    resumed = FallbackController("auto", "auto", "fp16")
    keys = {name: key for key, name in NAMES.items()}
    resumed.load_state_dict(saved, keys.__getitem__)
    assert resumed.choice == controller.choice and resumed.baseline == "fp16"
    assert resumed.decisions == controller.decisions
    with pytest.raises(ValueError, match="build it with the saved baseline"):
        FallbackController("auto", "fp32").load_state_dict(saved, keys.__getitem__)


def test_the_step_check_names_its_baseline(monkeypatch):
    checker, _ = _run_check(monkeypatch, [0.6, 0.5] * 3)
    check = checker.decide(_Local(), "x", "fp16")
    assert check.baseline == "fp16" and check.fallback
    assert "with the fp16 allreduce" in check.message()
    assert check.message().endswith("the fp16 allreduce carries every bucket from now on")
