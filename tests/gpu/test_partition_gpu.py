"""Green-context partitions on the GPU: the streams work, the primary context stays current, and a
consumer confined to its partition lets a producer on the other partition make progress."""

import pytest
import torch

from chunkring.partition import SmPartition

pytestmark = pytest.mark.gpu


def test_streams_run_torch_work_and_primary_context_stays_current(runtime):
    with SmPartition(runtime, producer_sms=16) as part:
        assert part.plan.producer_sms == 16 and part.consumer_sms >= 8
        a = torch.randn(256, 256, device=runtime.torch_device)
        results = []
        for stream in (part.producer_stream, part.consumer_stream):
            with torch.cuda.stream(stream):
                results.append(a @ a)
        torch.cuda.synchronize()
        assert torch.allclose(results[0], results[1])
        assert torch.cuda.current_stream().cuda_stream not in (part.producer_stream.cuda_stream,
                                                               part.consumer_stream.cuda_stream)
        # The primary context is current: an ordinary allocation and kernel still work.
        assert torch.ones(4, device=runtime.torch_device).sum().item() == 4
