"""Tensor maps for the copy engine's tiled copies (``cp.async.bulk.tensor``, device/include/chunkring/ptx/
bulk_copy.cuh): the 128-byte ``CUtensorMap`` that the driver's ``cuTensorMapEncodeTiled`` encodes on the host,
passed to a kernel parameter ``const __grid_constant__ TensorMap`` by a checked launch (:mod:`chunkring.jit.launch`).

:func:`tiled_arguments` checks a request against the driver's rules and returns the encoder's arguments (pure, no
GPU needed), :func:`encode_arguments` has the driver encode them; :func:`encode_tiled` does both for a CUDA tensor.
Shapes, strides and boxes are given in torch's order, outermost dimension first; the driver takes them innermost
first, and the conversion happens here once.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError

if TYPE_CHECKING:
    import torch

__all__ = ["DATA_TYPES", "L2_PROMOTIONS", "MAX_BOX", "SWIZZLES", "TensorMap", "TiledArguments", "encode_arguments",
           "encode_tiled", "tiled_arguments"]

#: torch dtype name -> (CUtensorMapDataType member, bytes per element). FP8 travels as bytes: the copy engine
#: moves them unchanged.
DATA_TYPES: dict[str, tuple[str, int]] = {
    "uint8": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1),
    "int8": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1),
    "float8_e4m3fn": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1),
    "float8_e5m2": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1),
    "float16": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT16", 2),
    "bfloat16": ("CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", 2),
    "float32": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT32", 4),
    "int32": ("CU_TENSOR_MAP_DATA_TYPE_INT32", 4),
    "int64": ("CU_TENSOR_MAP_DATA_TYPE_INT64", 8),
    "float64": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT64", 8),
}
#: Swizzle name -> (CUtensorMapSwizzle member, the widest box row in bytes it takes; None: no limit).
SWIZZLES: dict[str, tuple[str, int | None]] = {
    "none": ("CU_TENSOR_MAP_SWIZZLE_NONE", None),
    "32B": ("CU_TENSOR_MAP_SWIZZLE_32B", 32),
    "64B": ("CU_TENSOR_MAP_SWIZZLE_64B", 64),
    "128B": ("CU_TENSOR_MAP_SWIZZLE_128B", 128),
}
#: L2 promotion name -> CUtensorMapL2promotion member: the granule L2 fills from DRAM on a miss.
L2_PROMOTIONS: dict[str, str] = {
    "none": "CU_TENSOR_MAP_L2_PROMOTION_NONE",
    "64B": "CU_TENSOR_MAP_L2_PROMOTION_L2_64B",
    "128B": "CU_TENSOR_MAP_L2_PROMOTION_L2_128B",
    "256B": "CU_TENSOR_MAP_L2_PROMOTION_L2_256B",
}
#: The driver's limits: elements of a box along one dimension; dimensions; a dimension's size; a stride in bytes.
MAX_BOX, MAX_RANK, MAX_DIM, MAX_STRIDE_BYTES = 256, 5, 1 << 32, 1 << 40


@dataclass(frozen=True)
class TiledArguments:
    """What ``cuTensorMapEncodeTiled`` takes, innermost dimension first: element counts (``dims``, ``box``), byte
    strides of dimensions 1 .. rank - 1, and the enum members by name."""

    data_type: str
    address: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: str
    l2_promotion: str

    @property
    def box_bytes(self) -> int:
        """The bytes one copy of the box delivers (what a kernel announces to its barrier)."""
        count = 1
        for extent in self.box:
            count *= extent
        return count * next(size for member, size in DATA_TYPES.values() if member == self.data_type)


@dataclass(frozen=True)
class TensorMap:
    """An encoded tensor map: ``data`` the 128 bytes a ``const __grid_constant__ TensorMap`` parameter receives;
    ``device`` the GPU whose memory it describes; ``shape`` and ``box`` in torch's order. It holds its tensor, whose
    memory the map addresses, alive."""

    data: bytes
    device: torch.device
    shape: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: str
    source: torch.Tensor = field(repr=False, compare=False)


def tiled_arguments(*, address: int, dtype: str, shape: tuple[int, ...], strides: tuple[int, ...],
                    box: tuple[int, ...], swizzle: str = "128B", l2_promotion: str = "256B") -> TiledArguments:
    """The encoder's arguments for a tensor at ``address`` of ``dtype`` (a torch dtype's name), ``shape`` and
    ``strides`` (in elements, as ``Tensor.stride()``) and a ``box`` (elements per dimension), all outermost first.
    Raises ``ChunkringUsageError`` naming the field for anything the driver would refuse: a rank outside 1-5, an
    unsupported dtype, an address not on 16 bytes, an innermost dimension that is not contiguous, a stride that is
    not a multiple of 16 bytes or not under 2^40 bytes, a dimension outside 1 .. 2^32, a box extent outside
    1 .. 256, a box row that is not a multiple of 16 bytes or wider than the swizzle."""
    if dtype not in DATA_TYPES:
        raise ChunkringUsageError(f"dtype {dtype} has no tensor-map type; have {sorted(DATA_TYPES)}", field="tensor")
    if swizzle not in SWIZZLES:
        raise ChunkringUsageError(f"unknown swizzle {swizzle!r}; have {sorted(SWIZZLES)}", field="swizzle")
    if l2_promotion not in L2_PROMOTIONS:
        raise ChunkringUsageError(f"unknown L2 promotion {l2_promotion!r}; have {sorted(L2_PROMOTIONS)}",
                                  field="l2_promotion")
    rank = len(shape)
    if not 1 <= rank <= MAX_RANK or len(strides) != rank:
        raise ChunkringUsageError(f"a tensor map has 1 to {MAX_RANK} dimensions, got shape {shape} strides {strides}",
                                  field="tensor")
    if len(box) != rank:
        raise ChunkringUsageError(f"box {box} must have one extent per dimension of {shape}", field="box")
    member, size = DATA_TYPES[dtype]
    if address % 16:
        raise ChunkringUsageError(f"the address {address:#x} must be a multiple of 16 bytes", field="tensor")
    if strides[-1] != 1:
        raise ChunkringUsageError(f"the innermost dimension must be contiguous, stride {strides[-1]}", field="tensor")
    if any(not 1 <= d <= MAX_DIM for d in shape):
        raise ChunkringUsageError(f"every dimension must be in [1, 2^32], got {shape}", field="tensor")
    for stride in strides[:-1]:
        if (stride * size) % 16 or not 0 < stride * size < MAX_STRIDE_BYTES:
            raise ChunkringUsageError(f"strides {strides} (x {size} bytes) must be multiples of 16 bytes, under 2^40",
                                      field="tensor")
    if any(not 1 <= b <= MAX_BOX for b in box):
        raise ChunkringUsageError(f"every box extent must be in [1, {MAX_BOX}], got {box}", field="box")
    row_bytes, widest = box[-1] * size, SWIZZLES[swizzle][1]
    if row_bytes % 16:
        raise ChunkringUsageError(f"the box's innermost extent ({row_bytes} bytes) must be a multiple of 16 bytes",
                                  field="box")
    if widest is not None and row_bytes > widest:
        raise ChunkringUsageError(f"swizzle {swizzle} takes box rows of at most {widest} bytes, got {row_bytes}",
                                  field="box")
    return TiledArguments(member, address, tuple(reversed(shape)), tuple(s * size for s in reversed(strides[:-1])),
                          tuple(reversed(box)), SWIZZLES[swizzle][0], L2_PROMOTIONS[l2_promotion])


def encode_tiled(tensor: torch.Tensor, box: tuple[int, ...], *, swizzle: str = "128B",
                 l2_promotion: str = "256B") -> TensorMap:
    """A tiled tensor map of ``tensor`` (a CUDA tensor) with boxes of ``box`` elements (torch's order), checked by
    :func:`tiled_arguments`, encoded by the driver (``ChunkringRuntimeError`` if it refuses)."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ChunkringUsageError(f"expected a torch.Tensor, got {type(tensor).__name__}", field="tensor")
    if tensor.device.type != "cuda":
        raise ChunkringUsageError(f"a tensor map describes GPU memory; the tensor is on {tensor.device}",
                                  field="tensor")
    args = tiled_arguments(address=tensor.data_ptr(), dtype=str(tensor.dtype).removeprefix("torch."),
                           shape=tuple(tensor.shape), strides=tuple(tensor.stride()), box=tuple(box), swizzle=swizzle,
                           l2_promotion=l2_promotion)
    return TensorMap(encode_arguments(args), tensor.device, tuple(tensor.shape), tuple(box), swizzle, tensor)


def encode_arguments(args: TiledArguments) -> bytes:
    """The driver's 128-byte encoding of ``args`` (``ChunkringRuntimeError`` if it refuses them)."""
    from cuda.bindings import driver

    err, encoded = driver.cuTensorMapEncodeTiled(
        getattr(driver.CUtensorMapDataType, args.data_type), len(args.dims), args.address,
        [driver.cuuint64_t(d) for d in args.dims], [driver.cuuint64_t(s) for s in args.strides],
        [driver.cuuint32_t(b) for b in args.box], [driver.cuuint32_t(1)] * len(args.dims),
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, getattr(driver.CUtensorMapSwizzle, args.swizzle),
        getattr(driver.CUtensorMapL2promotion, args.l2_promotion),
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise ChunkringRuntimeError(f"cuTensorMapEncodeTiled({args}) failed: {err}")
    return _opaque_bytes(encoded)


def _opaque_bytes(encoded: Any) -> bytes:
    words = [int(w) for w in encoded.opaque]
    if len(words) != 16:
        raise ChunkringRuntimeError(f"a CUtensorMap has 16 words, the driver returned {len(words)}")
    return struct.pack("<16Q", *words)
