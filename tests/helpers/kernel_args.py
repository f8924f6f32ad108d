"""The kernel argument structs (device/include/chunkring/layout/kernel_args.cuh) as the tests read them: every host
mirror (a chunkring.jit.ArgStruct subclass) with the header that declares its struct, each kernel's body, and the code
that reads a struct - the bodies of the kernels that take it by value and of the functions of their sources that take
it as ``const FooArgs& args`` - with the fields it reads (``arg<T>(args.field)``) and the type it reads them as."""

from __future__ import annotations

import re

from benchmarks import probe_weight_read
from chunkring.jit import ArgStruct, kernel_sources, parse_kernels
from chunkring.jit.compiler import KERNEL_DIR
from chunkring.moe._engine import kernel_args as moe_kernel_args
from chunkring.ring import kernel_args as ring_kernel_args

__all__ = ["HEADERS", "field_reads", "kernel_bodies", "mirrors", "struct_code"]

#: Each header of argument structs (under device/include): the C++ namespace of its structs and the module that defines
#: their host mirrors.
HEADERS = {"chunkring/moe/kernel_args.cuh": ("chunkring::moe", moe_kernel_args),
           "chunkring/moe/probe_args.cuh": ("chunkring::moe", probe_weight_read),
           "chunkring/layout/ring_args.cuh": ("chunkring::layout", ring_kernel_args)}

#: A field read: ``arg<T>(args.field)``.
_READ = re.compile(r"\barg<\s*([^>]+?)\s*>\(\s*args\.(\w+)\s*\)")
_KERNEL = re.compile(r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+(\w+)\s*\(')
#: A function of a kernel source that takes an argument struct by reference: ``f(..., const FooArgs& args, ...) {``.
_HELPER = re.compile(r"\b\w+\s*\([^(){};]*\bconst\s+(\w+Args)\s*&\s*args\b[^(){};]*\)\s*(?=\{)")


def mirrors() -> dict[str, tuple[str, type[ArgStruct]]]:
    """Every host mirror (an ArgStruct subclass a module of :data:`HEADERS` defines) by its struct's name, with the
    header that declares the struct."""
    return {name: (header, value) for header, (_, module) in HEADERS.items() for name, value in vars(module).items()
            if isinstance(value, type) and issubclass(value, ArgStruct) and value.__module__ == module.__name__}


def _body(text: str, start: int) -> str:
    """The text between the brace at or after ``start`` and the brace that closes it."""
    start = text.index("{", start)
    depth, at = 0, start
    while True:
        depth += {"{": 1, "}": -1}.get(text[at], 0)
        if depth == 0:
            return text[start + 1:at]
        at += 1


def kernel_bodies() -> dict[str, str]:
    """Each ``extern "C"`` kernel's body (between its braces), by name, from every source."""
    bodies = {}
    for source in kernel_sources():
        text = (KERNEL_DIR / f"{source}.cu").read_text()
        bodies.update((match.group(1), _body(text, match.end())) for match in _KERNEL.finditer(text))
    return bodies


def struct_code() -> dict[str, dict[str, str]]:
    """Per argument struct, the code that reads it, by where: each kernel that takes it (its body) and each function
    of a kernel source that takes it as ``const FooArgs& args`` (``source.cu: helper``, its body)."""
    bodies, found = kernel_bodies(), {}
    for source in kernel_sources():
        text = (KERNEL_DIR / f"{source}.cu").read_text()
        for kernel, params in parse_kernels(text, source).items():
            for param in (p for p in params if p.struct):
                found.setdefault(param.struct, {})[kernel] = bodies[kernel]
        for match in _HELPER.finditer(text):
            name = match.group(0).split("(")[0].strip()
            found.setdefault(match.group(1), {})[f"{source}.cu: {name}"] = _body(text, match.end())
    return found


def field_reads(code: str) -> list[tuple[str, str]]:
    """Every ``arg<T>(args.field)`` of some code, in order: (field, T)."""
    return [(field, ctype) for ctype, field in _READ.findall(code)]
