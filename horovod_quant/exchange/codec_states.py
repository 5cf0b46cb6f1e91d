"""The adaptive state of the codecs an exchange runs, held by the exchange, not the codecs.

A codec is a value (:meth:`~horovod_quant.core.base.Codec.config_key` names it); one whose
encoding adapts between exchanges (NDQSG) gets its state from ``codec.new_state()``, and
:class:`CodecStates` keeps one such state per configuration for the exchanges of one door:
equal configurations share a codec object safely, and a checkpoint saves and restores the
states by configuration (:meth:`CodecStates.state_dict`), re-keyed for another number of
workers where a job resumes at another world size.
"""
from __future__ import annotations

import json
import threading
from typing import Any

from ..core.base import Codec, CodecState


class CodecStates:
    """One :class:`~horovod_quant.core.base.CodecState` per codec configuration, made when
    first asked for (stateless codecs have none); safe to share between threads (a door's
    exchanges may run on a worker thread, TensorFlow's callbacks on several)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, CodecState | None] = {}
        self._loaded: dict[str, dict[str, Any]] = {}  # restored before the codec was seen

    def of(self, codec: Codec) -> CodecState | None:
        """The state the exchanges of ``codec``'s configuration read and advance (None for a
        codec that does not adapt)."""
        key = codec.config_key()
        with self._lock:
            if key not in self._states:
                state = codec.new_state()
                if state is not None and key in self._loaded:
                    state.load_state_dict(self._loaded.pop(key))
                self._states[key] = state
            return self._states[key]

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """``{config_key: state}`` of every stateful configuration seen or restored."""
        with self._lock:
            saved = dict(self._loaded)
            saved.update({key: state.state_dict() for key, state in self._states.items()
                          if state is not None})
        return saved

    def load_state_dict(self, saved: dict[str, dict[str, Any]],
                        world_sizes: tuple[int, int] | None = None) -> list[str]:
        """Restore :meth:`state_dict`'s states; a configuration not seen yet takes its state
        when first asked for.

        Args:
            saved: what :meth:`state_dict` returned.
            world_sizes: ``(saved, now)``: the states of configurations built for ``saved``
                workers (their ``world_size``) become those of the same configuration built
                for ``now`` workers.

        Returns:
            The saved configurations so re-keyed.

        Raises:
            ValueError: ``saved`` is not such a mapping, or an entry does not fit its codec.
        """
        if not isinstance(saved, dict):
            raise ValueError(f"codec states must be the dict CodecStates.state_dict() gave, "
                             f"got {type(saved).__name__}")
        rekeyed = []
        if world_sizes is not None:
            saved = dict(saved)
            for key in list(saved):
                config = json.loads(key)
                if config.get("world_size") == world_sizes[0]:
                    config["world_size"] = world_sizes[1]
                    saved[json.dumps(config, sort_keys=True)] = saved.pop(key)
                    rekeyed.append(key)
        with self._lock:
            self._loaded = {}
            for key, state in saved.items():
                current = self._states.get(key)
                if current is not None:
                    current.load_state_dict(state)
                else:
                    self._loaded[key] = dict(state)
        return rekeyed
