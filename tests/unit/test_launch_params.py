"""Kernel arguments are checked against the declared signature before anything is enqueued."""

import numpy as np
import pytest
import torch

from chunkring._jit import Param
from chunkring.errors import ChunkringUsageError

CUDA0 = torch.device("cuda", 0)


def test_scalar_is_converted_to_exact_numpy_type():
    assert type(Param("n", "i32").convert(7, CUDA0)) is np.int32
    assert Param("g", "u64").convert((1 << 64) - 1, CUDA0) == np.uint64((1 << 64) - 1)


@pytest.mark.parametrize("kind,value", [("i32", 1 << 31), ("u32", -1), ("u64", 1 << 64), ("i32", 1.5), ("i32", True)])
def test_scalar_out_of_range_or_wrong_type(kind, value):
    with pytest.raises(ChunkringUsageError) as info:
        Param("x", kind).convert(value, CUDA0)
    assert info.value.field == "x"


def test_pointer_checks_device_dtype_and_layout():
    param = Param("buf", "ptr", torch.int64)
    with pytest.raises(ChunkringUsageError, match="is on cpu"):
        param.convert(torch.zeros(4, dtype=torch.int64), CUDA0)
    with pytest.raises(ChunkringUsageError, match="expected dtype"):
        param.convert(torch.zeros(4, dtype=torch.int32), CUDA0)
    with pytest.raises(ChunkringUsageError, match="contiguous"):
        param.convert(torch.zeros(4, 2, dtype=torch.int64).t(), CUDA0)
    with pytest.raises(ChunkringUsageError, match="torch.Tensor"):
        param.convert(1234, CUDA0)


def test_param_declaration_errors():
    with pytest.raises(ChunkringUsageError):
        Param("p", "ptr")
    with pytest.raises(ChunkringUsageError):
        Param("p", "f16")


def test_nullable_pointer_passes_null_only_when_declared():
    assert Param("count", "ptr", torch.int32, nullable=True).convert(None, CUDA0) == 0
    with pytest.raises(ChunkringUsageError, match="torch.Tensor"):
        Param("count", "ptr", torch.int32).convert(None, CUDA0)
    with pytest.raises(ChunkringUsageError, match="nullable"):
        Param("n", "i32", nullable=True)
