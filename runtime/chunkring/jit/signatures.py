"""Kernel parameters: :class:`Param` (one parameter and the check of one launch argument), and each
kernel's list of them, read from its ``extern "C" __global__`` signature in device/kernels/*.cu.

The signature in the .cu is the only declaration of a kernel's parameters. Each parameter's C type
becomes a :class:`Param` through one explicit table, :data:`C_TYPES`; a type the table does not name
is an error, never a guess. A pointer that may be null carries
``CHUNKRING_NULLABLE`` before its type (an empty macro, chunkring/util/kernel_params.cuh). A tensor map
(``TensorMap``, chunkring/ptx/bulk_copy.cuh) is taken by value as ``const __grid_constant__ TensorMap name``,
so that the copy engine reads it where the launch put it; its argument is a
:class:`chunkring.jit.tensor_map.TensorMap`.

The parser reads the source's own text with comments removed, not the preprocessor's output: a
signature must not depend on a macro, and every ``__global__`` function of a .cu must be declared
``extern "C" __global__ void name(...)`` (launches find kernels by their unmangled names). Anything
else is refused with its file and line rather than skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError

if TYPE_CHECKING:
    import torch

__all__ = ["C_TYPES", "GRID_CONSTANT", "NULLABLE", "Param", "parse_kernels"]

NULLABLE = "CHUNKRING_NULLABLE"
GRID_CONSTANT = "__grid_constant__"
#: The kind of a tensor-map parameter: 128 bytes passed by value (chunkring.jit.tensor_map.TensorMap).
TENSOR_MAP = "tensormap"

_SCALARS: dict[str, type[np.integer]] = {"i32": np.int32, "u32": np.uint32, "i64": np.int64, "u64": np.uint64}


@dataclass(frozen=True)
class Param:
    """One kernel parameter: ``kind`` is ``"ptr"`` (a CUDA tensor of ``dtype``; ``None`` passes a null
    pointer if ``nullable``), ``"tensormap"`` (a :class:`chunkring.jit.tensor_map.TensorMap` of the launch's GPU,
    passed by value) or a scalar kind."""

    name: str
    kind: str
    dtype: object = None  # torch.dtype, for pointers
    nullable: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("ptr", TENSOR_MAP) and self.kind not in _SCALARS:
            raise ChunkringUsageError(f"unknown parameter kind {self.kind!r}", field=self.name)
        if self.kind == "ptr" and self.dtype is None:
            raise ChunkringUsageError("a pointer parameter needs its dtype", field=self.name)
        if self.nullable and self.kind != "ptr":
            raise ChunkringUsageError("only a pointer parameter can be nullable", field=self.name)

    def convert(self, value: object, device: torch.device) -> int | np.integer | bytes:
        import torch

        if self.kind == TENSOR_MAP:
            from chunkring.jit.tensor_map import TensorMap

            if not isinstance(value, TensorMap):
                raise ChunkringUsageError(f"expected a chunkring.jit.tensor_map.TensorMap, got {type(value).__name__}",
                                          field=self.name)
            if value.device != device:
                raise ChunkringUsageError(f"tensor map is of {value.device}, kernel runs on {device}", field=self.name)
            return value.data
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
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ChunkringUsageError(f"expected an integer, got {type(value).__name__}", field=self.name)
        info = np.iinfo(_SCALARS[self.kind])
        if not info.min <= int(value) <= info.max:
            raise ChunkringUsageError(f"{value} does not fit {self.kind}", field=self.name)
        return _SCALARS[self.kind](value)


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
    if ctype not in C_TYPES:
        raise ChunkringRuntimeError(f"{where}: parameter {name!r} has type {ctype!r}, which no launch maps "
                                    f"(chunkring.jit.signatures.C_TYPES names {sorted(C_TYPES)})")
    kind, dtype = C_TYPES[ctype]
    if nullable and kind != "ptr":
        raise ChunkringRuntimeError(f"{where}: parameter {name!r} is {NULLABLE} but not a pointer")
    if (kind == TENSOR_MAP) != (grid_constant and const):
        raise ChunkringRuntimeError(f"{where}: parameter {name!r}: a TensorMap, and only a TensorMap, is taken as "
                                    f"`const {GRID_CONSTANT} TensorMap`")
    return Param(name, kind, getattr(torch, dtype) if dtype else None, nullable)


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
