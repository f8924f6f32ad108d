"""The stand-in kernel library of the CPU emulation (tests/helpers/emulation/machine.py is the machine it runs kernels
on): :class:`EmulatedLibrary` checks each launch as chunkring.jit's KernelLibrary checks it, against the signatures
parsed from the .cu files, and hands the emulated kernel its arguments as the device would see them. A kernel
argument struct (``const __grid_constant__ FooArgs args``, device/include/chunkring/layout/kernel_args.cuh) reaches the
emulated kernel as its fields, read from the bytes the launch would pass in the order of the header that declares it
and checked as ``require_args`` checks them (:meth:`EmulatedLibrary.struct_fields`): what the kernel's unpacking
into locals of the fields' names gives it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import torch

from chunkring.jit import ArgStruct, Param, parse_kernels
from chunkring.jit.launch import check_argument_names
from chunkring.jit.signatures import STRUCT
from tests.helpers.emulation.machine import (
    DEVICE,
    Allocation,
    EmulatedTrap,
    Memory,
    Pointer,
    header_constant,
    header_structs,
)

__all__ = ["EmulatedLibrary", "args_struct_fields"]


@functools.cache
def args_struct_fields(name: str) -> list[str]:
    """The words of kernel argument struct ``name`` in the order of the device header that declares it (every header
    under device/include/chunkring searched)."""
    root = DEVICE / "include"
    found = [fields for path in sorted((root / "chunkring").rglob("*.cuh"))
             for struct, fields in header_structs(str(path.relative_to(root))).items() if struct == name]
    assert len(found) == 1, f"{name}: declared by {len(found)} headers"
    return found[0]


class EmulatedLibrary:
    """A KernelLibrary stand-in that runs kernels on the CPU: each launch is checked as the real library checks it
    (every parameter named once, each tensor's dtype and contiguity, each integer's range, against the signatures
    parsed from the .cu files), recorded, and handed to ``kernels[name](memory, grid, block, shared_bytes, args)``
    with every pointer as its :class:`Allocation` (None: null) and every scalar as an int. A tensor not yet in
    ``memory`` is registered as ``initialised(tensor)`` says (default: uninitialised, the launches' own outputs
    come from ``torch.empty``; :meth:`EmptyTracker.initialised` tells the host's torch.empty from its zeros)."""

    def __init__(self, memory: Memory, kernels: dict[str, Callable], sources=("moe_decode.cu", "moe_experts.cu"),
                 initialised: Callable[[torch.Tensor], bool] = lambda tensor: False):
        self.memory, self.kernels, self.launches, self.initialised = memory, kernels, [], initialised
        self.signatures = {}
        for source in sources:
            self.signatures.update(parse_kernels((DEVICE / "kernels" / source).read_text(), source))

    def launch(self, name, /, *, grid, block, stream=None, shared_bytes=0, pdl=False, **args) -> None:
        values = self.arguments(name, args)
        self.launches.append((name, grid, block, args))
        self.memory.begin_launch()
        self.kernels[name](self.memory, int(grid), int(block), int(shared_bytes), values)

    def arguments(self, name: str, args: dict) -> SimpleNamespace:
        """The launch's arguments checked against the signature: pointers as Allocations, scalars as ints; an
        argument struct's fields in its place (:meth:`struct_fields`)."""
        params = self.signatures[name]
        check_argument_names(name, params, args)
        values = {}
        for param in params:
            param.convert(args[param.name], torch.device("cpu"))
            if param.kind == STRUCT:
                fields = self.struct_fields(f"{name}.{param.name}", args[param.name])
                assert not fields.keys() & values.keys(), f"{name}: a field is named as a parameter"
                values.update(fields)
            else:
                values[param.name] = self.value(f"{name}.{param.name}", param, args[param.name])
        return SimpleNamespace(**values)

    def value(self, what: str, param: Param, value):
        """One checked argument as the emulated kernel takes it: a pointer as its Allocation (a view into a registered
        tensor, as a stage's rows of one source: a Pointer into its allocation; null: None), a scalar as an int."""
        if param.kind != "ptr":
            return int(value)
        if value is None:
            return None
        inside = self.memory.find(value) is None and self.memory.holding(value.data_ptr())
        return Pointer(self.memory, value.data_ptr(), what) if inside else self.memory.add(
            value, what, initialised=self.initialised(value))

    def struct_fields(self, what: str, args: ArgStruct) -> dict:
        """An argument struct as its kernel unpacks it (``T field = arg<T>(args.field)``, a local of the field's
        name): the bytes the launch passes, read as words in the order of the header that declares the struct;
        ``require_args`` (version and size, else a trap); then each field as the type its mirror declares - the
        type the kernel reads, as tests/unit/test_kernel_args.py holds them - a pointer the allocation its word
        addresses, an integer its type's value of the word's low bits."""
        fields = args_struct_fields(type(args).__name__)
        words = dict(zip(fields, np.frombuffer(args.pack(torch.device("cpu")), np.uint64).tolist(), strict=True))
        version = header_constant("chunkring/layout/kernel_args.cuh", "kKernelArgsVersion")
        if words["version"] != version or words["bytes"] != 8 * len(fields):  # sizeof: u64 words only
            raise EmulatedTrap(f"require_args: {what} version {words['version']}, {words['bytes']} bytes")
        declared = {param.name: param for param in args.fields}
        values = {}
        for name in fields[2:]:
            param, word = declared[name], words[name]
            if param.kind == "ptr":
                value = values[name] = self.value(f"{what}.{name}", param, args[name])
                address = 0 if value is None else value.base if isinstance(value, Allocation) else value.address
                assert address == word, f"{what}.{name}: the word {word:#x} is not the tensor's address"
            else:
                bits = {"i32": 32, "u32": 32}.get(param.kind, 64)
                low = word % (1 << bits)
                values[name] = low - (1 << bits) if param.kind.startswith("i") and low >> (bits - 1) else low
        return values
