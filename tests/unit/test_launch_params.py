"""Kernel arguments are checked against the kernel's signature before anything is enqueued, and that
signature is read from the kernel's ``extern "C"`` declaration, refusing what no launch could map."""

import numpy as np
import pytest
import torch

from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError
from chunkring.jit import Param, parse_kernels
from chunkring.jit.launch import LAUNCH_KEYWORDS, check_argument_names

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


def test_signatures_come_from_the_extern_c_declaration():
    source = """
    // A comment is no declaration: extern "C" __global__ void ghost(int n);
    extern "C" __global__ void k(const RingDesc* desc, CHUNKRING_NULLABLE unsigned* arrivals,
                                 unsigned long long seed, int fp8, __nv_bfloat16* __restrict__ rows) {}
    extern "C" __global__ void __launch_bounds__(256, 2) empty(void) {}
    extern "C" __global__ __launch_bounds__(128) void one(int n);
    """
    assert parse_kernels(source) == {
        "k": (Param("desc", "ptr", torch.int64), Param("arrivals", "ptr", torch.int32, nullable=True),
              Param("seed", "u64"), Param("fp8", "i32"), Param("rows", "ptr", torch.bfloat16)),
        "empty": (),
        "one": (Param("n", "i32"),),
    }


@pytest.mark.parametrize("source,message", [
    ('extern "C" __global__ void k(double x) {}', "type 'double'"),
    ('extern "C" __global__ void k(int** p) {}', "type 'int\\*\\*'"),
    ('extern "C" __global__ void k(int*) {}', "needs a type and a name"),
    ('extern "C" __global__ void k(int n,) {}', "needs a type and a name"),
    ('extern "C" __global__ void k(int* p, int* p) {}', "repeats a parameter name"),
    ('extern "C" __global__ void k(CHUNKRING_NULLABLE int n) {}', "not a pointer"),
    ('extern "C" {\n__global__ void k(int n) {}\n}', "bad.cu:1: not a kernel signature"),
    ('__global__ void k(int n) {}', "not declared `extern \"C\"`"),
    ('extern "C" __global__ void k() {}\n\nextern "C" __global__ void k() {}',
     "bad.cu:3: kernel 'k' is declared twice"),
])
def test_a_signature_the_launches_cannot_map_is_refused(source, message):
    with pytest.raises(ChunkringRuntimeError, match=message):
        parse_kernels(source, "bad.cu")


def test_argument_names_must_be_the_kernel_parameters():
    params = (Param("desc", "ptr", torch.int64), Param("n", "i32"))
    check_argument_names("k", params, {"desc": None, "n": 1})
    with pytest.raises(ChunkringUsageError, match=r"k\(desc, n\): missing \['n'\], unknown \['count'\]") as info:
        check_argument_names("k", params, {"desc": None, "count": 1})
    assert info.value.field == "args"


def test_launch_keywords_are_not_parameter_names():
    assert {"grid", "block", "stream", "shared_bytes", "pdl"} == LAUNCH_KEYWORDS


def test_a_kernel_is_opted_in_to_more_shared_memory_than_the_default(monkeypatch):
    """Past 48 KiB of dynamic shared memory a launch fails unless its kernel allows that much: allow_dynamic_shared
    (which a library's launch calls for a size past what the kernel allows so far) sets the kernel's attribute, and
    a size the GPU refuses is a usage error naming the kernel, before anything is enqueued."""
    from types import SimpleNamespace

    from cuda.bindings import driver

    from chunkring.jit.launch import allow_dynamic_shared

    calls, answer = [], [driver.CUresult.CUDA_SUCCESS]
    monkeypatch.setattr(driver, "cuKernelSetAttribute",
                        lambda attribute, value, kernel, device: calls.append((attribute, value, kernel, device))
                        or (answer[0],))
    monkeypatch.setattr(driver, "CUkernel", lambda handle: ("kernel", handle))
    monkeypatch.setattr(driver, "CUdevice", lambda ordinal: ("device", ordinal))
    allow_dynamic_shared(SimpleNamespace(handle=7), 196608, 1, "k")
    attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    assert calls == [(attribute, 196608, ("kernel", 7), ("device", 1))]
    answer[0] = driver.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(ChunkringUsageError, match="k: 300000 bytes of dynamic shared memory") as info:
        allow_dynamic_shared(SimpleNamespace(handle=7), 300000, 1, "k")
    assert info.value.field == "shared_bytes"
