"""What ranks accept from each other and from the environment (the trust issue, no Horovod):
configuration checks, exchange tags, JSON between ranks, environment flags, seeds, rules."""
import pickle
import time
import warnings

import numpy as np
import pytest

import horovod_quant as hq
import horovod_quant.exchange
from horovod_quant.core.payload import Payload
from horovod_quant.doors import (
    OPTIMIZER_DOOR,
    TF_DOOR,
    TORCH_COMPRESSOR_DOOR,
    DoorEnvironment,
    Refusal,
    load_codec_states,
)
from horovod_quant.env import env_choice, env_flag, env_seconds, env_text
from horovod_quant.exchange import Exchange
from horovod_quant.exchange.check import CHECKS, ConfigCheck, wait_for_peers
from horovod_quant.exchange.codec_states import CodecStates
from horovod_quant.exchange.collectives import Handle, decode_objects, encode_object
from horovod_quant.exchange.wire import (
    OutOfStep,
    check_tags,
    exchange_tag,
    frame,
    norm_from_gathered,
    norm_wire,
)
from horovod_quant.policy import LayerPolicy
from horovod_quant.process_sets import world_communicator

from threaded_comm import run_ranks


def test_config_check_passes_when_ranks_agree():
    prefixes = run_ranks(3, lambda comm: ConfigCheck(comm, {"codec": "qsgd", "bits": 4}).wait())
    assert prefixes[0].endswith(".0") and len({p.rsplit(".", 1)[1] for p in prefixes}) == 1


def test_config_check_raises_the_same_error_on_every_rank():
    def rank_fn(comm):
        try:
            ConfigCheck(comm, {"bits": 4 if comm.rank == 1 else 8}).wait()
        except ValueError as exc:
            return str(exc)
        return None

    messages = run_ranks(3, rank_fn)
    assert messages[0] is not None and "differs between ranks" in messages[0]
    assert "rank 1: {'bits': 4}" in messages[0]
    assert len(set(messages)) == 1


def test_config_check_names_the_steps_of_ranks_at_odds():
    """One rank loaded a checkpoint alone: the check names each rank's step and the fix."""
    def rank_fn(comm):
        try:
            ConfigCheck(comm, {"codec": "qsgd", "step": 3 if comm.rank == 0 else 0}).wait()
        except ValueError as exc:
            return str(exc)

    messages = run_ranks(2, rank_fn)
    assert "rank 0 is at step 3, rank 1 is at step 0: load the checkpoint on every rank" in (
        messages[0]) and len(set(messages)) == 1


def test_codec_states_saved_at_another_world_size_are_adapted_with_one_warning():
    """NDQSG's state saved at 4 workers serves the codec built for 2, with one warning naming
    both sizes; a state of the same world size loads silently; a stateless codec's key stays."""
    old, new = (hq.get_codec("nested_dithered", world_size=n) for n in (4, 2))
    saved = {old.config_key(): {"sigma2": 0.25, "last_stats": {"k": 5}}}
    states = CodecStates()
    with pytest.warns(UserWarning) as caught:
        load_codec_states(states, saved, 4, 2, "test door")
    assert len(caught) == 1
    assert "saved at world size 4 and is loaded at world size 2" in str(caught[0].message)
    assert states.of(new).sigma2 == 0.25 and list(states.state_dict()) == [new.config_key()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same = CodecStates()
        load_codec_states(same, saved, 4, 4, "test door")
    assert same.of(old).sigma2 == 0.25


def test_a_door_refuses_to_go_on_after_an_error():
    refusal = Refusal("optimizer", "a new one")
    refusal.check()
    with pytest.raises(ValueError, match="out of step"):
        with refusal.guard():
            raise ValueError("the ranks are out of step\nsecond line")
    with pytest.raises(RuntimeError, match=r"stopped at an error \(ValueError: the ranks are "
                                           r"out of step\); .*build a new one"):
        with refusal.guard():
            raise AssertionError("not reached")


def test_checks_are_numbered_when_they_start_not_when_built():
    comm = hq.exchange.LocalCollectives()
    before = CHECKS.started(comm)
    check = ConfigCheck(comm, {"a": 1})
    assert CHECKS.started(comm) == before + 1
    assert check.wait() == f"hq.0.{before}"


class _Never(Handle):
    def wait(self):
        raise AssertionError("must not be waited for")

    def done(self):
        return False


def test_waiting_for_peers_has_a_deadline(monkeypatch):
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="waited .* for the test.*HQ_CONFIG_TIMEOUT"):
        wait_for_peers(_Never(), "the test", timeout=0.2)
    assert time.monotonic() - t < 5
    monkeypatch.setenv("HQ_CONFIG_TIMEOUT", "0.1")
    with pytest.raises(RuntimeError):  # the doors read the variable and pass it down
        wait_for_peers(_Never(), "the test", DoorEnvironment.read(TF_DOOR).config_timeout)


def test_objects_from_peers_are_json_never_pickle():
    blobs = np.concatenate([encode_object({"r": r, "t": (1, 2.5, None)}) for r in range(2)])
    assert decode_objects(blobs, 2) == [{"r": 0, "t": [1, 2.5, None]},
                                        {"r": 1, "t": [1, 2.5, None]}]
    evil = np.frombuffer(pickle.dumps({"r": 0}), np.uint8)
    framed = frame(Payload(evil, evil.size))
    with pytest.raises(ValueError, match="not JSON"):
        decode_objects(framed, 1)
    with pytest.raises(ValueError, match="declares"):
        decode_objects(blobs[:-3], 2)
    with pytest.raises(ValueError, match="expected 3"):
        decode_objects(blobs, 3)


def test_exchange_tags_catch_other_tensors_on_every_rank():
    """Rank 1 sends a tensor of another length under the same name: every rank raises before
    anything is combined (allgather and sra plans, and the norm of Global-QSGD)."""
    for name, params in [("qsgd", {}), ("natural", {}), ("global_qsgd", {"world_size": 3}),
                         ("global_qsgd", {"world_size": 3, "levels": "linear"})]:
        for gather in ("allgather", "sra"):
            codec = hq.get_codec(name, **params)

            def rank_fn(comm):
                x = np.ones(1000 if comm.rank != 1 else 800, np.float32)
                try:
                    Exchange(codec, comm, gather=gather).start(x, 1, "w").wait()
                except ValueError as exc:
                    return str(exc)

            messages = run_ranks(3, rank_fn)
            assert all(m is not None and "different tensors" in m for m in messages), (name, gather)
            assert "rank 1: 800 elements" in messages[0]


def test_exchanges_of_other_steps_raise_the_same_error_on_every_rank():
    """Rank 1 is one step ahead: its tag carries another step, so every rank raises the same
    OutOfStep naming each rank's step, before anything is combined (allgather, sra and the
    norm of Global-QSGD, with and without pieces)."""
    for name, params in [("qsgd", {}), ("nested_dithered", {"world_size": 3}),
                         ("global_qsgd", {"world_size": 3, "levels": "linear"})]:
        for gather, pipeline in (("allgather", None), ("sra", None), ("allgather", 256)):
            codec = hq.get_codec(name, **params)

            def rank_fn(comm):
                step = 4 if comm.rank == 1 else 3
                try:
                    Exchange(codec, comm, gather=gather, pipeline_elems=pipeline).start(
                        np.ones(1000, np.float32), 1, "w",
                        tag=exchange_tag("w", (1000,), step)).wait()
                except OutOfStep as exc:
                    return str(exc)

            messages = run_ranks(3, rank_fn)
            assert messages[0] is not None, (name, gather)
            assert "rank 0 at step 3, rank 1 at step 4, rank 2 at step 3" in messages[0]
            assert "Load the checkpoint on every rank" in messages[0]
            assert len(set(messages)) == 1, (name, gather)


def test_same_length_other_shape_is_caught_by_the_tag():
    assert exchange_tag("w", (4, 300)) != exchange_tag("w", (300, 4))
    assert exchange_tag("w", (4, 300))[0] == exchange_tag("w", (300, 4))[0] == 1200
    with pytest.raises(ValueError, match="different tensors"):
        check_tags([exchange_tag("w", (4, 300)), exchange_tag("w", (300, 4))], "w")


def test_norm_wire_carries_the_tag():
    codec = hq.get_codec("global_qsgd", world_size=2)
    a = norm_wire(codec, [np.ones(10, np.float32)], exchange_tag("w", (10,)))
    b = norm_wire(codec, [np.ones(10, np.float32)], exchange_tag("v", (10,)))
    assert norm_from_gathered(codec, np.concatenate([a, a])) == np.float32(1.0)
    with pytest.raises(ValueError, match="different tensors"):
        norm_from_gathered(codec, np.concatenate([a, b]), "w.norm")


@pytest.mark.parametrize("text,want", [("1", True), ("true", True), (" Yes ", True), ("ON", True),
                                       ("0", False), ("false", False), ("no", False),
                                       ("Off", False), ("", None)])
def test_boolean_environment_variables(monkeypatch, text, want):
    monkeypatch.setenv("HQ_TEST_FLAG", text)
    assert env_flag("HQ_TEST_FLAG") is want


@pytest.mark.parametrize("text", ["2", "maybe", "y e s"])
@pytest.mark.parametrize("door", [OPTIMIZER_DOOR, TORCH_COMPRESSOR_DOOR, TF_DOOR])
def test_bad_boolean_environment_variables_raise(monkeypatch, text, door):
    """At the door, when it is built (the Horovod doors read HQ_MPI_EXCHANGE)."""
    monkeypatch.setenv("HQ_MPI_EXCHANGE", text)
    with pytest.raises(ValueError, match="HQ_MPI_EXCHANGE"):
        DoorEnvironment.read(door)


@pytest.mark.parametrize("text", ["false", "no", "off", "0"])
def test_mpi_exchange_can_be_switched_off_in_any_spelling(monkeypatch, text):
    monkeypatch.setenv("HQ_MPI_EXCHANGE", text)
    mpi_exchange = DoorEnvironment.read(TORCH_COMPRESSOR_DOOR).mpi_exchange
    monkeypatch.delenv("HQ_MPI_EXCHANGE")  # read at the door: nothing below it looks again
    assert mpi_exchange is False
    assert world_communicator(object(), mpi_exchange) is None  # decided before Horovod is asked


def test_seconds_environment_variables(monkeypatch):
    monkeypatch.setenv("HQ_CONFIG_TIMEOUT", "2.5")
    assert env_seconds("HQ_CONFIG_TIMEOUT", 600) == 2.5
    for bad in ("-1", "0", "soon", "inf"):
        monkeypatch.setenv("HQ_CONFIG_TIMEOUT", bad)
        with pytest.raises(ValueError, match="HQ_CONFIG_TIMEOUT"):
            env_seconds("HQ_CONFIG_TIMEOUT", 600)


def test_choice_and_text_environment_variables(monkeypatch):
    monkeypatch.setenv("HQ_TRANSPORT", " gloo ")
    assert env_choice("HQ_TRANSPORT", ("auto", "gloo"), "auto") == "gloo"
    monkeypatch.setenv("HQ_TRANSPORT", "")
    assert env_choice("HQ_TRANSPORT", ("auto", "gloo"), "auto") == "auto"
    monkeypatch.setenv("HQ_TRANSPORT", "tcp")
    with pytest.raises(ValueError, match="HQ_TRANSPORT='tcp' is not valid"):
        env_choice("HQ_TRANSPORT", ("auto", "gloo"), "auto")
    monkeypatch.setenv("HQ_PEER_ADDR", "  10.0.0.1 ")
    assert env_text("HQ_PEER_ADDR") == "10.0.0.1"
    monkeypatch.setenv("HQ_PEER_ADDR", " ")
    assert env_text("HQ_PEER_ADDR") is None


@pytest.mark.parametrize("seed", [7.9, 7.0, "7", True, None])
def test_non_integral_seeds_are_refused(seed):
    with pytest.raises(TypeError, match="integer"):
        hq.derive_key(seed, 1)
    with pytest.raises(TypeError, match="integer"):
        hq.derive_key(1, seed)
    codec = hq.get_codec("qsgd")
    with pytest.raises((TypeError, ValueError)):
        codec.encode(np.ones(10, np.float32), seed=seed)


def test_numpy_integer_seeds_are_accepted():
    assert hq.derive_key(np.int64(7), np.uint32(3)) == hq.derive_key(7, 3)


def test_rules_take_codecs_none_and_compressor_like_objects():
    eight = hq.get_codec("qsgd", bits=8)

    class Wrapped:  # what Compression.<name>(...) objects look like to the policy
        codec = hq.get_codec("natural")

    policy = LayerPolicy(rules=[(r"^a$", eight), (r"^b$", Wrapped()), (r"^c$", None),
                                (r"^d$", hq.get_codec("none"))], min_elements=0)
    default = hq.get_codec("qsgd", bits=4)
    assert policy.codec_for(default, (8, 8), "a") is eight
    assert policy.codec_for(default, (8, 8), "b").name == "natural"
    assert policy.codec_for(default, (8, 8), "c") is None
    assert policy.codec_for(default, (8, 8), "d") is None
    assert policy.codec_for(default, (8, 8), "e") is default
    assert policy.codec_for(default, (8, 8), None) is default
    assert [c.config() for c in policy.codecs(default)] == [
        default.config(), eight.config(), Wrapped.codec.config()]
    with pytest.raises(TypeError, match="rule 'x'"):
        LayerPolicy(rules=[("x", "qsgd")])


def test_importing_the_package_turns_numba_highlighting_off():
    """numba's highlighting runs colorama.init(), whose exit hook printed ESC[0m on every rank
    under Open MPI (a terminal stdout); a user's own setting wins."""
    import os
    import subprocess
    import sys

    code = "import os, horovod_quant; print(os.environ['NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING'])"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "1", out.stderr
    env["NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "0", out.stderr
