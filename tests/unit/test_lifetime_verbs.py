"""One lifetime verb (issue 43 item 5): every public object that holds resources frees them with ``close()`` - the
runtime, a ring, a layer, a gather's outputs, an SM partition - none offers another verb for itself (``destroy``,
``free``, ``release``; ``Runtime.free(tensor)`` returns a tensor it allocated, the pair of ``alloc``), and the
collective objects a caller scopes (a ring, a layer, a gather's outputs) are context managers whose exit closes them.
Read from the classes, no GPU; tests/unit/test_ring_lifetime.py runs a ring's close, and tests/lifetime its cycles on
the GPU."""

import inspect

import pytest

from chunkring import GatherOutputs, MoELayer, Ring, Runtime, SmPartition
from tests.helpers.host_layer import config, host_layer

OWNERS = (Runtime, Ring, MoELayer, GatherOutputs, SmPartition)


@pytest.mark.parametrize("cls", OWNERS, ids=lambda c: c.__name__)
def test_close_is_the_one_verb_that_frees(cls):
    assert callable(getattr(cls, "close", None))
    others = [verb for verb in ("destroy", "free", "release", "dispose")
              if hasattr(cls, verb) and list(inspect.signature(getattr(cls, verb)).parameters) == ["self"]]
    assert not others, f"{cls.__name__} also frees by {others}"


@pytest.mark.parametrize("cls", (Ring, MoELayer, GatherOutputs), ids=lambda c: c.__name__)
def test_what_a_caller_scopes_is_a_context_manager(cls):
    assert callable(getattr(cls, "__enter__", None)) and callable(getattr(cls, "__exit__", None))


def test_a_layers_with_block_closes_it(monkeypatch):
    layer = host_layer(monkeypatch, config())
    with layer as entered:
        assert entered is layer and "closed" not in repr(layer)
    assert "closed" in repr(layer)
    layer.close()  # a second close does nothing
