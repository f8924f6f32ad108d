"""The graph launch probe's host pieces without a GPU: a driver call's values come back as the call returned them and a
failed status raises naming it (chunkring.jit.graph_nodes.ok, which the probe reads graphs with), and the probe's
host timing takes each sample behind a fresh delay, the device drained between samples, a second launch first where
asked."""

import pytest

from benchmarks import probe_graph_launch as probe
from chunkring.jit.graph_nodes import ok

driver = pytest.importorskip("cuda.bindings.driver")
SUCCESS = driver.CUresult.CUDA_SUCCESS


def test_a_driver_call_gives_its_values():
    assert ok((SUCCESS,)) is None
    assert ok((SUCCESS, 7)) == 7
    assert ok((SUCCESS, "nodes", 3)) == ("nodes", 3)


def test_a_failed_driver_call_raises_its_status():
    with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_VALUE"):
        ok((driver.CUresult.CUDA_ERROR_INVALID_VALUE, 0))


@pytest.mark.parametrize("again", [False, True])
def test_host_timing_gates_each_sample(monkeypatch, again):
    events = []
    monkeypatch.setattr(probe.torch.cuda, "synchronize", lambda: events.append("sync"))

    def gate():
        events.append("gate")
        return lambda: False  # the delay still holds
    median = probe.host_us(lambda: events.append("launch"), gate, 3, again=again)
    sample = ["gate", "launch", "launch", "sync"] if again else ["gate", "launch", "sync"]
    assert events == sample * 3
    assert median >= 0.0


def test_the_replay_ops_copy_each_input_count_the_rows_and_clone_the_output():
    """``replay_ops`` issues what a replayed call issues around its launch, on buffers of the layer's capacity: each
    input into its buffer's first rows, the count, a fresh copy of the output's rows."""
    torch = pytest.importorskip("torch")
    inputs = (torch.randn(3, 8), torch.randn(3, 2), torch.arange(6, dtype=torch.int32).view(3, 2), torch.rand(3, 2))
    out = torch.randn(3, 8)
    issue = probe.replay_ops(16, inputs, out)
    cloned = issue()
    assert cloned.shape == (3, 8) and cloned.data_ptr() != out.data_ptr()
    again = issue()
    assert again.data_ptr() != cloned.data_ptr()  # one clone a call, as a replayed call returns
