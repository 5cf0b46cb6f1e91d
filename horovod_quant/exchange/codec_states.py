"""The adaptive state of the codecs an exchange runs, held by the exchange, not the codecs.

A codec is a value (:meth:`~horovod_quant.core.base.Codec.config_key` names it); one whose
encoding adapts between exchanges (NDQSG) gets its state from ``codec.new_state()``, and
:class:`CodecStates` keeps one such state per configuration for the exchanges of one door:
equal configurations share a codec object safely, and a checkpoint saves and restores the
states by configuration (:meth:`CodecStates.state_dict`).
"""
from __future__ import annotations

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

    def load_state_dict(self, saved: dict[str, dict[str, Any]]) -> None:
        """Restore :meth:`state_dict`'s states; a configuration not seen yet takes its state
        when first asked for.

        Raises:
            ValueError: ``saved`` is not such a mapping, or an entry does not fit its codec.
        """
        if not isinstance(saved, dict):
            raise ValueError(f"codec states must be the dict CodecStates.state_dict() gave, "
                             f"got {type(saved).__name__}")
        with self._lock:
            self._loaded = {}
            for key, state in saved.items():
                current = self._states.get(key)
                if current is not None:
                    current.load_state_dict(state)
                else:
                    self._loaded[key] = dict(state)
