"""The machine underneath the CPU emulation of CUDA kernels (tests/helpers/emulation/decode.py runs the kernels on
it): global memory as the bytes of the very torch tensors a launch names, addressed by their ``data_ptr()``; a
thread block as numpy arrays over ``threadIdx.x``; the number formats (fp32 with fmaf, bf16 and e4m3 round to
nearest even, e4m3 saturating); the mma.sync.m16n8k32 e4m3 fragment tables of the PTX ISA. The stand-in kernel
library that runs kernels on it is tests/helpers/emulation/library.py's.

Every load and store names the allocation its base pointer came from and is checked there: in bounds, naturally
aligned (the absolute address), only initialised bytes read (memory from ``torch.empty`` is uninitialised until a
kernel writes it), and no byte stored twice in one launch (two threads storing one place is a race, or one of the
two stores is misplaced). A failed check raises :class:`EmulatedMemoryError` with the access named. Atomics are
checked like loads (bounds, alignment, initialised) but are exempt from the one-store rule: they are how threads
share a word. A pointer read from memory (a descriptor's field) is a :class:`Pointer`, resolved where it is used."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

__all__ = ["E4M3_VALUES", "WARP", "Allocation", "EmptyTracker", "EmulatedMemoryError", "EmulatedTrap", "Memory",
           "Pointer", "Threads", "bf16_bits", "e4m3_bits", "fmaf", "header_constant", "header_enum", "header_structs",
           "mma_m16n8k32_e4m3", "read_struct", "round_bf16", "shfl_xor"]

DEVICE = Path(__file__).resolve().parents[3] / "device"
WARP = 32
#: The value of every e4m3 byte (float8_e4m3fn: 0x7f and 0xff are NaN).
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()


def header_structs(header: str) -> dict[str, list[str]]:
    """The u64 fields of each struct of a device header (a path under device/include), in declaration order: the
    emulated kernels read descriptors in the device's field order, not the host mirror's."""
    text = (DEVICE / "include" / header).read_text()
    return {name: re.findall(r"^\s*u64 (\w+);", body, re.M)
            for name, body in re.findall(r"struct (\w+) \{(.*?)\n\};", text, re.S)}


def header_enum(header: str, name: str) -> dict[str, int]:
    """The enumerators of enum ``name`` of a device header, by name (``kFoo = 3`` entries)."""
    text = (DEVICE / "include" / header).read_text()
    body = re.search(rf"enum (?:class )?{name}\b[^{{]*\{{(.*?)\}};", text, re.S).group(1)
    return {k: int(v) for k, v in re.findall(r"(k\w+) = (\d+)", body)}


def header_constant(header: str, name: str) -> int:
    """``constexpr u64 name = value;`` of a device header."""
    return int(re.search(rf"{name} = (\d+);", (DEVICE / "include" / header).read_text()).group(1))


def read_struct(desc, fields: list[str], what: str) -> SimpleNamespace:
    """``*desc`` for a struct of u64 ``fields``: every word loaded (an Allocation or a Pointer), by field name."""
    words = desc.load_as(np.uint64, np.arange(len(fields)), what)
    return SimpleNamespace(**{f: int(w) for f, w in zip(fields, words, strict=True)})


class EmulatedMemoryError(AssertionError):
    """An access the hardware would make wrongly: out of bounds, misaligned, uninitialised, or a second store."""


class EmulatedTrap(AssertionError):
    """A kernel executed __trap() (require_descriptor on a descriptor, or require_args on an argument struct, of
    another version or size)."""


@dataclass(eq=False)
class Allocation:
    """One tensor's bytes (shared with the tensor: a store changes it) and, per byte, whether it holds a value
    and how often the current launch stored it."""

    tensor: torch.Tensor
    name: str
    initialised: bool
    raw: np.ndarray = field(init=False)
    valid: np.ndarray = field(init=False)
    stores: np.ndarray = field(init=False)
    stored_in: np.ndarray = field(init=False)  # per byte, the launch that last stored it (-1: none)
    launch: int = 0  # the launch running now (Memory.begin_launch / switch): the one-store rule's scope

    def __post_init__(self) -> None:
        assert self.tensor.is_contiguous() and self.tensor.device.type == "cpu"
        self.raw = self.tensor.reshape(-1).view(torch.uint8).numpy()
        self.valid = np.full(self.raw.size, self.initialised)
        self.stores = np.zeros(self.raw.size, np.int32)
        self.stored_in = np.full(self.raw.size, -1, np.int64)

    @property
    def base(self) -> int:
        return self.tensor.data_ptr()

    def _bytes(self, offsets, size: int, what: str) -> np.ndarray:
        off = np.asarray(offsets, dtype=np.int64)
        if off.size and (off.min() < 0 or off.max() + size > self.raw.size):
            bad = off[(off < 0) | (off + size > self.raw.size)]
            raise EmulatedMemoryError(f"{what}: byte offsets {bad[:4].tolist()} past {self.name} "
                                      f"({self.raw.size} bytes)")
        if off.size and ((self.base + off) % size).any():
            raise EmulatedMemoryError(f"{what}: a {size}-byte access of {self.name} is misaligned")
        return off[..., None] + np.arange(size)

    def load(self, offsets, size: int, what: str) -> np.ndarray:
        """The ``size`` bytes at each byte offset: uint8 [*offsets.shape, size]."""
        at = self._bytes(offsets, size, what)
        if not self.valid[at].all():
            raise EmulatedMemoryError(f"{what}: reads uninitialised bytes of {self.name}")
        return self.raw[at]

    def store(self, offsets, data: np.ndarray, what: str, again: bool = False) -> None:
        """``data`` uint8 [*offsets.shape, size] to the byte offsets. ``again``: a rewrite in place (a value
        checked where the launch put it, as moe_pull's routing): every byte must have been stored by this launch."""
        at = self._bytes(offsets, data.shape[-1], what)
        if at.size and again:
            if not (self.stored_in[at] == self.launch).all():
                raise EmulatedMemoryError(f"{what}: rewrites bytes of {self.name} this launch never stored")
            self.raw[at] = data
        elif at.size:
            if len(np.unique(at)) != at.size or (self.stored_in[at] == self.launch).any():
                raise EmulatedMemoryError(f"{what}: stores a byte of {self.name} twice in one launch")
            self.raw[at], self.valid[at] = data, True
            self.stores[at] += 1
            self.stored_in[at] = self.launch

    # Typed views of load/store: offsets in elements of the type, as the kernel's pointer arithmetic counts them,
    # from byte ``at`` of the allocation (a Pointer's place in it).
    def load_as(self, dtype, elements, what: str, at: int = 0) -> np.ndarray:
        size = np.dtype(dtype).itemsize
        return self.load(at + np.asarray(elements, np.int64) * size, size, what).view(dtype)[..., 0]

    def store_as(self, dtype, elements, values, what: str, at: int = 0, again: bool = False) -> None:
        size = np.dtype(dtype).itemsize
        values = np.ascontiguousarray(np.broadcast_to(np.asarray(values, dtype), np.shape(elements)))
        self.store(at + np.asarray(elements, np.int64) * size, values.view(np.uint8).reshape(*values.shape, size),
                   what, again)

    def atomic_add_as(self, dtype, elements, values, what: str, at: int = 0) -> np.ndarray:
        """atomicAdd of ``values`` at each element, applied in array order (duplicates included, wrapping as the
        type wraps); returns what each atomic read. Not a store for the one-store rule."""
        size = np.dtype(dtype).itemsize
        el = np.asarray(elements, np.int64).reshape(-1)
        add = np.broadcast_to(np.asarray(values, np.int64), np.shape(elements)).reshape(-1)
        old = self.load_as(dtype, el, what, at).astype(np.int64)
        for i in range(1, el.size):  # the earlier atomics on the same element, in order
            old[i] += add[:i][el[:i] == el[i]].sum()
        ends = {int(e): o + a for e, o, a in zip(el, old, add, strict=True)}  # the last atomic per element wins
        keys = np.array(list(ends), np.int64)
        new = np.array(list(ends.values()), np.int64).astype(dtype).view(np.uint8).reshape(len(keys), size)
        self.raw[self._bytes(at + keys * size, size, what)] = new
        return old.astype(dtype).reshape(np.shape(elements))

    def cas_as(self, dtype, element: int, compare, value, what: str, at: int = 0):
        """atomicCAS of one element: stores ``value`` if it holds ``compare``; returns what it held."""
        old = self.load_as(dtype, element, what, at)
        if old == np.asarray(compare, dtype):
            size = np.dtype(dtype).itemsize
            self.raw[self._bytes(at + element * size, size, what)] = np.asarray(value, dtype).reshape(1).view(np.uint8)
        return old


class Memory:
    """The allocations a problem's launches touch, found by address (a pointer read from memory, as
    moe_combine_push's peer_combine entries, is resolved here)."""

    def __init__(self) -> None:
        self.allocations: list[Allocation] = []
        self.launch = self.launched = 0  # the launch running now; how many began

    def add(self, tensor: torch.Tensor, name: str, *, initialised: bool = True) -> Allocation:
        """Register ``tensor``; initialised=False models ``torch.empty`` (nothing readable before a store)."""
        found = self.find(tensor)
        if found is not None:
            return found
        alloc = Allocation(tensor, name, initialised)
        alloc.launch = self.launch
        ends = [(a.base, a.base + a.raw.size) for a in self.allocations]
        assert all(alloc.base + alloc.raw.size <= lo or alloc.base >= hi for lo, hi in ends), "overlapping tensors"
        self.allocations.append(alloc)
        return alloc

    def find(self, tensor: torch.Tensor) -> Allocation | None:
        for a in self.allocations:
            if a.base == tensor.data_ptr() and a.raw.size == tensor.numel() * tensor.element_size():
                return a
        return None

    def holding(self, address: int) -> bool:
        """Whether byte ``address`` lies in a registered allocation."""
        return any(a.base <= address < a.base + a.raw.size for a in self.allocations)

    def at(self, address: int, what: str) -> tuple[Allocation, int]:
        """The allocation holding byte ``address``, and the address's offset in it."""
        for a in self.allocations:
            if a.base <= address < a.base + a.raw.size:
                return a, address - a.base
        raise EmulatedMemoryError(f"{what}: address {address:#x} is in no allocation")

    def begin_launch(self) -> int:
        """A new launch: nothing stored in it yet. Returns its id (for :meth:`switch`)."""
        self.launched += 1
        self.switch(self.launched)
        for a in self.allocations:
            a.stores[:] = 0
        return self.launch

    def switch(self, launch: int) -> None:
        """Continue launch ``launch`` (kernels that run concurrently, interleaved: each its own one-store rule)."""
        self.launch = launch
        for a in self.allocations:
            a.launch = launch


@dataclass(frozen=True)
class Pointer:
    """A device address the kernel read from memory (a descriptor's field): each access finds the allocation
    holding it then, so a pointer that is never dereferenced (an empty tensor's, maybe null) is never looked up;
    an access past the allocation it points into is an error there."""

    memory: Memory
    address: int
    name: str

    def target(self, what: str) -> tuple[Allocation, int]:
        return self.memory.at(self.address, f"{what} ({self.name})")

    def load_as(self, dtype, elements, what: str) -> np.ndarray:
        elements = np.asarray(elements, np.int64)
        if elements.size == 0:
            return np.zeros(elements.shape, dtype)
        alloc, at = self.target(what)
        return alloc.load_as(dtype, elements, what, at)

    def load(self, offsets, size: int, what: str) -> np.ndarray:
        alloc, at = self.target(what)
        return alloc.load(at + np.asarray(offsets, np.int64), size, what)

    def store(self, offsets, data: np.ndarray, what: str) -> None:
        alloc, at = self.target(what)
        alloc.store(at + np.asarray(offsets, np.int64), data, what)

    def store_as(self, dtype, elements, values, what: str, again: bool = False) -> None:
        alloc, at = self.target(what)
        alloc.store_as(dtype, elements, values, what, at, again)

    def atomic_add_as(self, dtype, elements, values, what: str) -> np.ndarray:
        alloc, at = self.target(what)
        return alloc.atomic_add_as(dtype, elements, values, what, at)

    def cas_as(self, dtype, element: int, compare, value, what: str):
        alloc, at = self.target(what)
        return alloc.cas_as(dtype, element, compare, value, what, at)


class EmptyTracker:
    """Which tensors the host made with ``torch.empty`` (uninitialised memory) while installed: ``torch.empty``
    wrapped through ``monkeypatch``, each result's storage noted. :meth:`initialised` is the
    :class:`EmulatedLibrary` policy for a tensor a launch names first: torch.zeros / torch.full memory holds
    values, torch.empty memory holds nothing a kernel may read before storing it."""

    def __init__(self, monkeypatch) -> None:
        self.storages: set[int] = set()
        real = torch.empty

        def empty(*args, **kwargs):
            t = real(*args, **kwargs)
            if t.numel():
                self.storages.add(t.untyped_storage().data_ptr())
            return t

        monkeypatch.setattr(torch, "empty", empty)

    def initialised(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() not in self.storages


@dataclass(frozen=True)
class Threads:
    """One block's threads as arrays over threadIdx.x (warps of 32 consecutive threads)."""

    count: int

    @property
    def tid(self) -> np.ndarray:
        return np.arange(self.count, dtype=np.int64)

    @property
    def lane(self) -> np.ndarray:
        return self.tid % WARP

    @property
    def warp(self) -> np.ndarray:
        return self.tid // WARP


def shfl_xor(values: np.ndarray, offset: int) -> np.ndarray:
    """__shfl_xor_sync(0xffffffff, v, offset) over a block's threads (axis 0), every lane active."""
    lanes = np.arange(values.shape[0]) % WARP
    return values[(np.arange(values.shape[0]) - lanes) + (lanes ^ offset)]


def fmaf(a, b, c) -> np.ndarray:
    """fmaf in fp32: the product of two fp32 is exact in fp64; the sum is rounded in fp64, then to fp32 (a double
    rounding where the exact sum needs more than 53 bits: off by at most one fp32 unit from the real fmaf)."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(np.float32)


def bf16_bits(values) -> np.ndarray:
    """__float2bfloat16_rn of fp32 values: their bf16 bytes, uint8 [..., 2]."""
    flat = torch.from_numpy(np.ascontiguousarray(values, np.float32).reshape(-1)).to(torch.bfloat16)
    return flat.view(torch.int16).numpy().view(np.uint8).reshape(*np.shape(values), 2)


def round_bf16(values) -> np.ndarray:
    """__bfloat162float(__float2bfloat16_rn(v)): fp32 rounded to bf16's 8 bits, as fp32."""
    return torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(torch.bfloat16).float().numpy()


def e4m3_bits(values) -> np.ndarray:
    """__nv_fp8_e4m3(v) of fp32 values (round to nearest even, saturating to +-448): uint8, one per value."""
    flat = torch.from_numpy(np.ascontiguousarray(values, np.float32).reshape(-1)).to(torch.float8_e4m3fn)
    return flat.view(torch.uint8).numpy().reshape(np.shape(values))


def _fragment_tables():
    """The PTX ISA's mma.m16n8k32 fragments for 8-bit types (g = lane / 4, t = lane % 4; byte i of a register
    is element i): a[r] holds A[g + 8 (r % 2)][4t + 16 (r / 2) + i], b[r] holds B[4t + 16 r + i][g], c[i] is
    C[g + 8 (i / 2)][2t + i % 2]. Each table is checked to cover its matrix exactly once."""
    lane, reg, byte = np.meshgrid(np.arange(WARP), np.arange(4), np.arange(4), indexing="ij")
    g, t = lane // 4, lane % 4
    a = (g + 8 * (reg % 2), 4 * t + 16 * (reg // 2) + byte)
    b = (4 * t[:, :2] + 16 * reg[:, :2] + byte[:, :2], g[:, :2])
    c_lane, c_i = np.meshgrid(np.arange(WARP), np.arange(4), indexing="ij")
    c = (c_lane // 4 + 8 * (c_i // 2), 2 * (c_lane % 4) + c_i % 2)
    for (rows, cols), shape in ((a, (16, 32)), (b, (32, 8)), (c, (16, 8))):
        cells = sorted(zip(rows.ravel().tolist(), cols.ravel().tolist(), strict=True))
        assert cells == [(r, k) for r in range(shape[0]) for k in range(shape[1])]
    return a, b, c


A_FRAGMENT, B_FRAGMENT, C_FRAGMENT = _fragment_tables()


def mma_m16n8k32_e4m3(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 for every warp of a block at once: c fp32 [threads, 4],
    a uint8 [threads, 4 registers, 4 bytes], b uint8 [threads, 2, 4]; returns d. The 32 products of each output
    are summed exactly (fp64 holds any sum of 32 e4m3 products) and added to c with one rounding to fp32: the
    tensor core's own order and internal precision are not modelled."""
    warps = c.shape[0] // WARP
    A, B = np.zeros((warps, 16, 32)), np.zeros((warps, 32, 8))
    A[:, A_FRAGMENT[0], A_FRAGMENT[1]] = E4M3_VALUES[a].reshape(warps, WARP, 4, 4)
    B[:, B_FRAGMENT[0], B_FRAGMENT[1]] = E4M3_VALUES[b].reshape(warps, WARP, 2, 4)
    d = (A @ B)[:, C_FRAGMENT[0], C_FRAGMENT[1]].reshape(-1, 4)
    return (c.astype(np.float64) + d).astype(np.float32)
