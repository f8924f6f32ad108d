"""Kernel parameters: :class:`Param` (one parameter and the check of one launch argument), and each
kernel's list of them, read from its ``extern "C" __global__`` signature in device/kernels/*.cu.

The signature in the .cu is the only declaration of a kernel's parameters. Each parameter's C type
becomes a :class:`Param` through one explicit table, :data:`C_TYPES`; a type the table does not name
is an error, never a guess. A pointer that may be null carries
``CHUNKRING_NULLABLE`` before its type (an empty macro, chunkring/util/kernel_params.cuh). A tensor map
(``TensorMap``, chunkring/ptx/bulk_copy.cuh) is taken by value as ``const __grid_constant__ TensorMap name``,
so that the copy engine reads it where the launch put it; its argument is a
:class:`chunkring.jit.tensor_map.TensorMap`. A kernel argument struct (``FooArgs``: a device header's struct of
64-bit words, mirrored by an :class:`ArgStruct` subclass of that name) is taken by value the same way,
``const __grid_constant__ FooArgs args``; its argument is an instance of the mirror.

The parser reads the source's own text with comments removed, not the preprocessor's output: a
signature must not depend on a macro, and every ``__global__`` function of a .cu must be declared
``extern "C" __global__ void name(...)`` (launches find kernels by their unmangled names). Anything
else is refused with its file and line rather than skipped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from struct import Struct
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError

if TYPE_CHECKING:
    import torch

__all__ = ["C_TYPES", "GRID_CONSTANT", "KERNEL_ARGS_VERSION", "NULLABLE", "STRUCT", "ArgStruct", "Param",
           "check_argument_names", "parse_kernels", "parse_params"]

NULLABLE = "CHUNKRING_NULLABLE"
GRID_CONSTANT = "__grid_constant__"
#: The kind of a tensor-map parameter: 128 bytes passed by value (chunkring.jit.tensor_map.TensorMap).
TENSOR_MAP = "tensormap"
#: The kind of a kernel argument struct's parameter: its bytes passed by value (an ArgStruct).
STRUCT = "struct"
#: How an argument struct's C type is spelled: a capitalised name ending in Args.
_STRUCT_TYPE = re.compile(r"[A-Z]\w*Args")

_SCALARS: dict[str, type[np.integer]] = {"i32": np.int32, "u32": np.uint32, "i64": np.int64, "u64": np.uint64}
#: Each scalar kind's range, (min, max), read once: every launch checks its scalars against it.
_RANGES: dict[str, tuple[int, int]] = {kind: (int(np.iinfo(t).min), int(np.iinfo(t).max))
                                       for kind, t in _SCALARS.items()}


@dataclass(frozen=True)
class Param:
    """One kernel parameter: ``kind`` is ``"ptr"`` (a CUDA tensor of ``dtype``; ``None`` passes a null
    pointer if ``nullable``), ``"tensormap"`` (a :class:`chunkring.jit.tensor_map.TensorMap` of the launch's GPU,
    passed by value), ``"struct"`` (an instance of the :class:`ArgStruct` subclass named
    ``struct``, its bytes passed by value) or a scalar kind."""

    name: str
    kind: str
    dtype: object = None  # torch.dtype, for pointers
    nullable: bool = False
    struct: str | None = None  # the C struct's name, for an argument struct

    def __post_init__(self) -> None:
        if self.kind not in ("ptr", TENSOR_MAP, STRUCT) and self.kind not in _SCALARS:
            raise ChunkringUsageError(f"unknown parameter kind {self.kind!r}", field=self.name)
        if (self.kind == STRUCT) != (self.struct is not None):
            raise ChunkringUsageError("an argument struct's parameter, and only one, names its struct",
                                      field=self.name)
        if self.kind == "ptr" and self.dtype is None:
            raise ChunkringUsageError("a pointer parameter needs its dtype", field=self.name)
        if self.nullable and self.kind != "ptr":
            raise ChunkringUsageError("only a pointer parameter can be nullable", field=self.name)

    def convert(self, value: object, device: torch.device) -> int | np.integer | bytes:
        import torch

        # Every launch converts every argument: the common kinds first.
        if self.kind == "ptr":
            if value is None and self.nullable:
                return 0  # cuda.core passes a Python int as intptr_t: the null pointer
            if not isinstance(value, torch.Tensor):
                raise ChunkringUsageError(f"expected a torch.Tensor, got {type(value).__name__}", field=self.name)
            if value.dtype != self.dtype:
                raise ChunkringUsageError(f"expected dtype {self.dtype}, got {value.dtype}", field=self.name)
            if not value.is_contiguous():
                raise ChunkringUsageError("tensor must be contiguous", field=self.name)
            if value.device != device:
                raise ChunkringUsageError(f"tensor is on {value.device}, kernel runs on {device}", field=self.name)
            return value.data_ptr()
        if self.kind in _RANGES:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ChunkringUsageError(f"expected an integer, got {type(value).__name__}", field=self.name)
            low, high = _RANGES[self.kind]
            if not low <= int(value) <= high:
                raise ChunkringUsageError(f"{value} does not fit {self.kind}", field=self.name)
            return _SCALARS[self.kind](value)
        if self.kind == STRUCT:
            if not isinstance(value, ArgStruct) or type(value).__name__ != self.struct:
                raise ChunkringUsageError(f"expected a {self.struct} (a chunkring.jit.ArgStruct), got "
                                          f"{type(value).__name__}", field=self.name)
            return value.pack(device)
        from chunkring.jit.tensor_map import TensorMap  # TENSOR_MAP, the one kind left

        if not isinstance(value, TensorMap):
            raise ChunkringUsageError(f"expected a chunkring.jit.tensor_map.TensorMap, got {type(value).__name__}",
                                      field=self.name)
        if value.device != device:
            raise ChunkringUsageError(f"tensor map is of {value.device}, kernel runs on {device}", field=self.name)
        return value.data


#: C type of a parameter (``const`` and ``__restrict__`` dropped) -> (Param kind, dtype of the tensor
#: a pointer takes, by its torch name). torch's unsigned types wider than 8 bits lack most operations,
#: so unsigned words travel in the signed tensor of their width. ``u32``/``u64`` are chunkring's names
#: for ``cuda::std::uint32_t``/``uint64_t``.
C_TYPES: dict[str, tuple[str, str | None]] = {
    "RingDesc*": ("ptr", "int64"),  # Ring.desc: the descriptor's u64 words as an int64 tensor
    "StageDesc*": ("ptr", "int64"),  # chunkring.moe._engine.stage.Stage.desc, likewise
    "PoolDesc*": ("ptr", "int64"),  # chunkring.moe._engine.blocks.BlockPool.desc, likewise
    "int*": ("ptr", "int32"),
    "unsigned*": ("ptr", "int32"),
    "u32*": ("ptr", "int32"),
    "long long*": ("ptr", "int64"),
    "unsigned long long*": ("ptr", "int64"),
    "u64*": ("ptr", "int64"),
    "unsigned char*": ("ptr", "uint8"),
    "float*": ("ptr", "float32"),
    "__nv_bfloat16*": ("ptr", "bfloat16"),
    "__nv_fp8_e4m3*": ("ptr", "float8_e4m3fn"),
    "int": ("i32", None),
    "unsigned": ("u32", None),
    "u32": ("u32", None),
    "long long": ("i64", None),
    "unsigned long long": ("u64", None),
    "u64": ("u64", None),
    "TensorMap": (TENSOR_MAP, None),  # only as `const __grid_constant__ TensorMap`
}

# Comments, and the string and character literals a comment marker may hide in (kept as they are).
_COMMENT_OR_LITERAL = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.S)
_EXTERN_C = re.compile(r'\bextern\s*"C"')
_BOUNDS = r"(?:__launch_bounds__\s*\([^()]*\)\s*)?"  # allowed before or after `void`
_KERNEL = re.compile(
    rf'extern\s*"C"\s+__global__\s+{_BOUNDS}void\s+{_BOUNDS}([A-Za-z_]\w*)\s*\(([^()]*)\)\s*(?=[{{;])'
)
_GLOBAL = re.compile(r"\b__global__\b")
_TOKEN = re.compile(r"[A-Za-z_]\w*|\S")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_TYPE_WORDS = {"int", "unsigned", "signed", "long", "short", "char", "float", "double", "void", "volatile"}
_DROPPED = {"const", "__restrict__"}


def _blank_comments(text: str) -> str:
    # Blanked character for character, so an offset into the result is an offset into the source.
    def blank(match: re.Match[str]) -> str:
        found = match.group(0)
        return found if found[0] in "\"'" else re.sub(r"[^\n]", " ", found)

    return _COMMENT_OR_LITERAL.sub(blank, text)


def _line(code: str, offset: int) -> int:
    return code.count("\n", 0, offset) + 1


def _param(text: str, where: str) -> Param:
    import torch

    tokens = _TOKEN.findall(text)
    nullable, grid_constant, const = NULLABLE in tokens, GRID_CONSTANT in tokens, "const" in tokens
    tokens = [t for t in tokens if t not in (NULLABLE, GRID_CONSTANT) and t not in _DROPPED]
    if len(tokens) < 2 or not _IDENTIFIER.fullmatch(tokens[-1]) or tokens[-1] in _TYPE_WORDS:
        raise ChunkringRuntimeError(f"{where}: parameter {text.strip()!r} needs a type and a name")
    name, ctype = tokens[-1], " ".join(tokens[:-1]).replace(" *", "*")
    if _STRUCT_TYPE.fullmatch(ctype):
        if not (grid_constant and const) or nullable:
            raise ChunkringRuntimeError(f"{where}: parameter {name!r}: an argument struct is taken by value, as "
                                        f"`const {GRID_CONSTANT} {ctype} {name}`")
        return Param(name, STRUCT, struct=ctype)
    if ctype not in C_TYPES:
        raise ChunkringRuntimeError(f"{where}: parameter {name!r} has type {ctype!r}, which no launch maps "
                                    f"(chunkring.jit.signatures.C_TYPES names {sorted(C_TYPES)})")
    kind, dtype = C_TYPES[ctype]
    if nullable and kind != "ptr":
        raise ChunkringRuntimeError(f"{where}: parameter {name!r} is {NULLABLE} but not a pointer")
    if (kind == TENSOR_MAP) != (grid_constant and const):
        raise ChunkringRuntimeError(f"{where}: parameter {name!r}: a TensorMap is taken as `const {GRID_CONSTANT} "
                                    "TensorMap`, and nothing else is but an argument struct (FooArgs)")
    return Param(name, kind, getattr(torch, dtype) if dtype else None, nullable)


def parse_params(text: str, where: str) -> tuple[Param, ...]:
    """C declarations separated by commas, as a kernel's parameter list spells them (``"const int* counts, int n"``),
    each mapped as a parameter of that type is; ``where`` names them in the error for one it cannot map."""
    code = _blank_comments(text)
    return tuple(_param(piece, where) for piece in code.split(",")) if code.strip() else ()


def parse_kernels(text: str, filename: str = "<source>") -> dict[str, tuple[Param, ...]]:
    """Every ``extern "C"`` kernel of a kernel source, in source order: ``{name: (Param, ...)}``.
    Raises ``ChunkringRuntimeError`` naming ``filename`` and the line for a signature it cannot read."""
    code = _blank_comments(text)
    kernels: dict[str, tuple[Param, ...]] = {}
    for extern in _EXTERN_C.finditer(code):
        where = f"{filename}:{_line(code, extern.start())}"
        match = _KERNEL.match(code, extern.start())
        if match is None:
            raise ChunkringRuntimeError(f'{where}: not a kernel signature of the form '
                                        f'`extern "C" __global__ void name(type name, ...)`')
        name, params = match.group(1), match.group(2)
        if name in kernels:
            raise ChunkringRuntimeError(f"{where}: kernel {name!r} is declared twice")
        parsed, offset = [], match.start(2)
        for piece in params.split(",") if params.strip() not in ("", "void") else []:
            line = _line(code, offset + len(piece) - len(piece.lstrip()))
            parsed.append(_param(piece, f"{filename}:{line}: {name}"))
            offset += len(piece) + 1
        names = [p.name for p in parsed]
        if len(set(names)) != len(names):
            raise ChunkringRuntimeError(f"{where}: kernel {name!r} repeats a parameter name: {names}")
        kernels[name] = tuple(parsed)
    others = len(_GLOBAL.findall(code)) - len(kernels)
    if others:
        raise ChunkringRuntimeError(f'{filename}: {others} __global__ function(s) not declared `extern "C"`: '
                                    "launches find kernels by their unmangled names")
    return kernels


def check_argument_names(name: str, params: tuple[Param, ...], args: Mapping[str, object]) -> None:
    """Raise ``ChunkringUsageError`` naming every parameter of kernel (or argument struct) ``name`` that ``args``
    lacks and every argument that names no parameter."""
    expected = [param.name for param in params]
    missing = [p for p in expected if p not in args]
    unknown = sorted(set(args) - set(expected))
    if missing or unknown:
        raise ChunkringUsageError(f"{name}({', '.join(expected)}): missing {missing}, unknown {unknown}",
                                  field="args")


#: The layout of every kernel argument struct; == device/include/chunkring/layout/kernel_args.cuh kKernelArgsVersion.
#: Bumped whenever the words' layout rule changes (a struct's own fields are held by its size and the unit test).
KERNEL_ARGS_VERSION = 1
_WORD_BITS = 64
#: The words every argument struct starts with (require_args checks them before the kernel reads a field).
_HEAD = ("version", "bytes")


class ArgStruct:
    """The host mirror of a kernel argument struct (``const __grid_constant__ FooArgs args``): a subclass named as
    the C struct, whose ``FIELDS`` declare its fields after ``version`` and ``bytes`` in the header's order, as a
    kernel's parameter list would (``"const StageDesc* stage, int block_m, CHUNKRING_NULLABLE int* own_row"``: the
    types of :data:`C_TYPES`). The struct is one 64-bit word per field (device/include/chunkring/layout/
    kernel_args.cuh): a pointer's address (null 0), an integer sign- or zero-extended.

    An instance takes every field by name, ``PlanScatterArgs(stage=..., block_m=128, ...)`` (a missing or unknown
    name is a ``ChunkringUsageError``); a launch converts each field as it converts a parameter of its type (dtype,
    contiguity, device, range: :meth:`words`) and passes the bytes by value."""

    FIELDS: ClassVar[str] = ""
    #: Derived from FIELDS: the fields as parameters, every word's name (version, bytes, the fields) and the size.
    fields: ClassVar[tuple[Param, ...]] = ()
    names: ClassVar[tuple[str, ...]] = _HEAD
    nbytes: ClassVar[int] = 8 * len(_HEAD)
    _field_names: ClassVar[frozenset[str]] = frozenset()
    _packer: ClassVar[Struct] = Struct(f"<{len(_HEAD)}Q")

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        fields = parse_params(cls.FIELDS, f"{cls.__name__}.FIELDS")
        names = [field.name for field in fields]
        bad = [f.name for f in fields if f.kind in (TENSOR_MAP, STRUCT)] + [n for n in names if n in _HEAD]
        if bad or len(set(names)) != len(names) or not _STRUCT_TYPE.fullmatch(cls.__name__):
            raise ChunkringRuntimeError(f"{cls.__name__}: an argument struct is named FooArgs and its fields are "
                                        f"pointers and integers, each named once and not {_HEAD}: {names}")
        cls.fields, cls.names = fields, (*_HEAD, *names)
        cls.nbytes = 8 * len(cls.names)
        cls._field_names = frozenset(names)
        cls._packer = Struct(f"<{len(cls.names)}Q")

    def __init__(self, **values: object) -> None:
        if values.keys() != self._field_names:
            check_argument_names(type(self).__name__, self.fields, values)
        self.values: Mapping[str, object] = MappingProxyType(values)

    def __getitem__(self, name: str) -> object:
        return self.values[name]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self.values)})"

    def words(self, device: torch.device) -> list[int]:
        """Every word as the kernel reads it, in order: the version, the size, then each field converted as a
        parameter of its type is (a tensor's address, 0 for a null pointer, an integer modulo 2^64). A field that
        does not convert raises ``ChunkringUsageError`` naming it, as a loose parameter's would."""
        return [KERNEL_ARGS_VERSION, self.nbytes,
                *(int(field.convert(self.values[field.name], device)) % (1 << _WORD_BITS) for field in self.fields)]

    def pack(self, device: torch.device) -> bytes:
        """The struct's bytes, as the launch passes them (:meth:`words`, little-endian)."""
        return self._packer.pack(*self.words(device))
