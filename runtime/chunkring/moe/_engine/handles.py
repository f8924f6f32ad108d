"""The integers that name live layers to the PyTorch operators (:mod:`chunkring.moe.op`): an operator's
arguments are tensors and scalars only, so a layer travels as its handle.

The registry holds layers weakly (it keeps none alive). Handles count up from 1 and are never reused, so a
stale handle never names a newer layer. It sits below the layer and the operators, which both use it, so
neither imports the other.
"""

from __future__ import annotations

import itertools
import weakref

__all__ = ["lookup", "register"]

_layers: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
_next_handle = itertools.count(1)


def register(layer: object) -> int:
    """A new handle naming ``layer`` (a layer registers itself once, when it is built)."""
    handle = next(_next_handle)
    _layers[handle] = layer
    return handle


def lookup(handle: int) -> object | None:
    """The live object ``handle`` names, or None (never registered, or garbage-collected)."""
    return _layers.get(handle)
