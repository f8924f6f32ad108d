"""Tensor maps (chunkring.jit.tensor_map) and the launches that pass them, without a GPU: every request the driver's
cuTensorMapEncodeTiled would refuse is refused first, naming the field; the driver receives the dimensions innermost
first and strides in bytes; a kernel parameter ``const __grid_constant__ TensorMap`` is read from the signature
and nothing else passes for it; and the driver launch path (cuLaunchKernelEx, which takes the 128 bytes by value)
lays out every parameter as the kernel reads it, and sets the dependent-launch attribute for pdl."""

import ctypes
import struct
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError
from chunkring.jit import Param, parse_kernels
from chunkring.jit.launch import launch_by_driver
from chunkring.jit.tensor_map import TensorMap, encode_arguments, encode_tiled, tiled_arguments

CUDA0 = torch.device("cuda", 0)
# The flash shape's w13 of 32 experts as the probe views it: [32 * 4096, 4096] bytes, at a 256-byte boundary.
W13 = dict(address=0x7F00_0000_0100, dtype="float8_e4m3fn", shape=(32 * 4096, 4096), strides=(4096, 1))


def test_a_2d_fp8_map_is_given_to_the_driver_innermost_first():
    args = tiled_arguments(**W13, box=(128, 64), swizzle="128B", l2_promotion="256B")
    assert args.dims == (4096, 32 * 4096) and args.strides == (4096,) and args.box == (64, 128)
    assert args.data_type == "CU_TENSOR_MAP_DATA_TYPE_UINT8" and args.box_bytes == 128 * 64
    assert (args.swizzle, args.l2_promotion) == ("CU_TENSOR_MAP_SWIZZLE_128B", "CU_TENSOR_MAP_L2_PROMOTION_L2_256B")
    wide = tiled_arguments(address=0, dtype="bfloat16", shape=(8, 512, 256), strides=(512 * 256, 256, 1),
                           box=(1, 64, 64), swizzle="none")
    assert wide.strides == (512, 512 * 256 * 2) and wide.box_bytes == 64 * 64 * 2  # bytes, innermost first


@pytest.mark.parametrize("change,field,message", [
    ({"address": W13["address"] + 8}, "tensor", "multiple of 16"),
    ({"dtype": "bool"}, "tensor", "no tensor-map type"),
    ({"shape": (4096,) * 6, "strides": (1,) * 6}, "tensor", "1 to 5 dimensions"),
    ({"strides": (4096, 2)}, "tensor", "contiguous"),
    ({"strides": (4100, 1)}, "tensor", "multiples of 16"),
    ({"shape": (1 << 33, 4096)}, "tensor", r"2\^32"),
    ({"box": (128,)}, "box", "one extent per dimension"),
    ({"box": (257, 64)}, "box", r"\[1, 256\]"),
    ({"box": (0, 64)}, "box", r"\[1, 256\]"),
    ({"box": (128, 24)}, "box", "multiple of 16 bytes"),
    ({"box": (128, 256)}, "box", "at most 128 bytes"),   # 128-byte swizzling, a 256-byte box row
    ({"swizzle": "256B"}, "swizzle", "unknown swizzle"),
    ({"l2_promotion": "512B"}, "l2_promotion", "unknown L2 promotion"),
])
def test_what_the_driver_would_refuse_is_refused_naming_the_field(change, field, message):
    request = {**W13, "box": (128, 128), "swizzle": "128B", **change}
    with pytest.raises(ChunkringUsageError, match=message) as info:
        tiled_arguments(**request)
    assert info.value.field == field


def test_an_unswizzled_map_takes_a_256_byte_box_row():
    assert tiled_arguments(**W13, box=(128, 256), swizzle="none").box_bytes == 128 * 256


def test_encode_tiled_refuses_what_is_not_gpu_memory():
    with pytest.raises(ChunkringUsageError, match="GPU memory") as info:
        encode_tiled(torch.zeros(256, 256, dtype=torch.uint8), (128, 128))
    assert info.value.field == "tensor"
    with pytest.raises(ChunkringUsageError, match="torch.Tensor"):
        encode_tiled(np.zeros((256, 256), np.uint8), (128, 128))  # type: ignore[arg-type]


def test_the_driver_gets_the_checked_arguments_and_its_128_bytes_come_back(monkeypatch):
    from cuda.bindings import driver

    seen = {}

    def encoder(data_type, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2, oob):
        seen.update(data_type=data_type, rank=rank, address=address, dims=[int(d) for d in dims],
                    strides=[int(s) for s in strides], box=[int(b) for b in box],
                    element_strides=[int(e) for e in element_strides], swizzle=swizzle, l2=l2)
        return driver.CUresult.CUDA_SUCCESS, SimpleNamespace(opaque=list(range(100, 116)))

    monkeypatch.setattr(driver, "cuTensorMapEncodeTiled", encoder)
    data = encode_arguments(tiled_arguments(**W13, box=(128, 128)))
    assert data == struct.pack("<16Q", *range(100, 116))
    assert seen == dict(data_type=driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, rank=2,
                        address=W13["address"], dims=[4096, 32 * 4096], strides=[4096], box=[128, 128],
                        element_strides=[1, 1], swizzle=driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                        l2=driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B)
    monkeypatch.setattr(driver, "cuTensorMapEncodeTiled",
                        lambda *args: (driver.CUresult.CUDA_ERROR_INVALID_VALUE, None))
    with pytest.raises(ChunkringRuntimeError, match="cuTensorMapEncodeTiled"):
        encode_arguments(tiled_arguments(**W13, box=(128, 128)))


def tensor_map(device=CUDA0, data=bytes(range(128))):
    return TensorMap(data, device, (256, 256), (128, 128), "128B", torch.zeros(1))


def test_a_tensor_map_parameter_takes_only_a_tensor_map_of_the_kernels_gpu():
    param = Param("w13_map", "tensormap")
    assert param.convert(tensor_map(), CUDA0) == bytes(range(128))
    with pytest.raises(ChunkringUsageError, match="TensorMap") as info:
        param.convert(bytes(128), CUDA0)
    assert info.value.field == "w13_map"
    with pytest.raises(ChunkringUsageError, match="kernel runs on"):
        param.convert(tensor_map(device=torch.device("cuda", 1)), CUDA0)


KERNEL = 'extern "C" __global__ void k(const __grid_constant__ TensorMap map, const int* x, int n) {}'


def test_a_tensor_map_is_declared_const_grid_constant_and_nothing_else_is():
    (params,) = parse_kernels(KERNEL).values()
    assert [(p.name, p.kind) for p in params] == [("map", "tensormap"), ("x", "ptr"), ("n", "i32")]
    for wrong in ('extern "C" __global__ void k(TensorMap map) {}',
                  'extern "C" __global__ void k(const TensorMap map) {}',
                  'extern "C" __global__ void k(__grid_constant__ TensorMap map) {}',
                  'extern "C" __global__ void k(const __grid_constant__ int n) {}'):
        with pytest.raises(ChunkringRuntimeError, match="const __grid_constant__ TensorMap"):
            parse_kernels(wrong)


def test_the_driver_launch_lays_out_every_parameter_as_the_kernel_reads_it(monkeypatch):
    from cuda.bindings import driver

    params = (Param("map", "tensormap"), Param("x", "ptr", torch.int32), Param("n", "i32"), Param("g", "u64"),
              Param("m", "u32"))
    values = [bytes(range(128)), 0xDEAD_BEEF_0000, np.int32(-5), np.uint64((1 << 64) - 2), np.uint32(7)]
    seen = {}

    def launcher(config, function, kernel_params, extra):
        at = (ctypes.c_void_p * len(params)).from_address(kernel_params)
        c = config
        seen.update(function=int(function), shared=c.sharedMemBytes, stream=int(c.hStream), extra=extra,
                    dims=(c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY, c.blockDimZ),
                    attributes=[(a.id, a.value.programmaticStreamSerializationAllowed) for a in c.attrs[:c.numAttrs]],
                    map=ctypes.string_at(at[0], 128), map_aligned=at[0] % 64 == 0,
                    x=ctypes.c_uint64.from_address(at[1]).value, n=ctypes.c_int32.from_address(at[2]).value,
                    g=ctypes.c_uint64.from_address(at[3]).value, m=ctypes.c_uint32.from_address(at[4]).value)
        return (driver.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(driver, "cuLaunchKernelEx", launcher)
    launch_by_driver(SimpleNamespace(handle=0x1234), "k", params, values, grid=132, block=(384,), shared_bytes=99328,
                     stream_handle=0x77)
    assert seen == dict(function=0x1234, dims=(132, 1, 1, 384, 1, 1), shared=99328, stream=0x77, extra=0,
                        attributes=[], map=bytes(range(128)), map_aligned=True, x=0xDEAD_BEEF_0000, n=-5,
                        g=(1 << 64) - 2, m=7)
    launch_by_driver(SimpleNamespace(handle=0x1234), "k", params, values, grid=(2, 3), block=64, shared_bytes=0,
                     stream_handle=0x77, pdl=True)
    pdl = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert seen["dims"] == (2, 3, 1, 64, 1, 1) and seen["attributes"] == [(pdl, 1)]
    with pytest.raises(ChunkringUsageError) as info:
        launch_by_driver(SimpleNamespace(handle=1), "k", params, values, grid=(1, 1, 1, 1), block=1, shared_bytes=0,
                         stream_handle=0)
    assert info.value.field == "grid"
    monkeypatch.setattr(driver, "cuLaunchKernelEx", lambda *args: (driver.CUresult.CUDA_ERROR_INVALID_VALUE,))
    with pytest.raises(ChunkringRuntimeError, match="launch of k failed"):
        launch_by_driver(SimpleNamespace(handle=1), "k", params, values, grid=1, block=1, shared_bytes=0,
                         stream_handle=0)


def test_launch_configurations_are_reused_only_for_the_same_values(monkeypatch):
    """The driver's launch configuration is made once per (grid, block, shared bytes, stream, pdl) and reused: a
    launch with other values gets its own, whichever came first, and a grid given as a list keys as its tuple."""
    from cuda.bindings import driver

    params, values = (Param("n", "i32"),), [np.int32(1)]
    seen = []

    def launcher(config, function, kernel_params, extra):
        seen.append((config, (config.gridDimX, config.gridDimY), int(config.hStream), config.numAttrs))
        return (driver.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(driver, "cuLaunchKernelEx", launcher)
    for grid, stream, pdl in (((2, 3), 5, True), ((2, 3), 5, False), ([2, 3], 5, True), ((2, 3), 6, True),
                              ((2, 3), 5, True)):
        launch_by_driver(SimpleNamespace(handle=1), "k", params, values, grid=grid, block=32, shared_bytes=0,
                         stream_handle=stream, pdl=pdl)
    assert [s[1:] for s in seen] == [((2, 3), 5, 1), ((2, 3), 5, 0), ((2, 3), 5, 1), ((2, 3), 6, 1), ((2, 3), 5, 1)]
    configs = [s[0] for s in seen]
    assert configs[0] is configs[2] is configs[4] and len({id(c) for c in configs}) == 3
