"""Kernel argument structs (device/include/chunkring/layout/kernel_args.cuh; host mirrors: chunkring.jit.ArgStruct) are
one layout in two languages: each mirror names its header struct's words in order (read as the emulation reads them,
header_structs), has the size the header's static_assert pins, declares each field with the type the header's comment
names and the code of its kernels reads it as (``arg<T>(args.field)``, every field, after ``require_args``); every
header struct has a mirror and the version is the header's. No kernel takes ten or more loose parameters (LOOSE would
name an exception with its reason; there is none). And the mirror itself: it packs each field as a launch converts a
parameter of that type, refuses what a launch would, naming the field, and a kernel's signature takes a struct only
by value."""

import re
import struct

import pytest
import torch

from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError
from chunkring.jit import ArgStruct, Param, kernel_sources, parse_kernels
from chunkring.jit.compiler import KERNEL_DIR
from chunkring.jit.signatures import KERNEL_ARGS_VERSION, parse_params
from tests.helpers.emulation.machine import DEVICE, header_constant, header_structs
from tests.helpers.kernel_args import HEADERS, field_reads, kernel_bodies, mirrors, struct_code

CPU = torch.device("cpu")
#: The most loose parameters a kernel takes; past it, an argument struct.
LOOSE_LIMIT = 9
#: Kernels over the limit, and why they are.
LOOSE: dict[str, str] = {}
MIRRORS = mirrors()


class ToyArgs(ArgStruct):
    FIELDS = "const int* counts, CHUNKRING_NULLABLE float* maybe, int n, long long big, unsigned u, u64 word"


def toy(**change):
    values = dict(counts=torch.zeros(4, dtype=torch.int32), maybe=None, n=-3, big=-(1 << 40), u=7, word=(1 << 64) - 1)
    return ToyArgs(**{**values, **change})


def test_a_mirror_packs_its_words_as_the_kernel_reads_them():
    args = toy()
    assert ToyArgs.names == ("version", "bytes", "counts", "maybe", "n", "big", "u", "word")
    assert ToyArgs.nbytes == 8 * 8
    words = [KERNEL_ARGS_VERSION, 64, args["counts"].data_ptr(), 0, (1 << 64) - 3, (1 << 64) - (1 << 40), 7,
             (1 << 64) - 1]
    assert args.words(CPU) == words
    assert args.pack(CPU) == struct.pack("<8Q", *words)
    maybe = torch.zeros(2)
    assert toy(maybe=maybe).words(CPU)[3] == maybe.data_ptr()


@pytest.mark.parametrize(("change", "field", "message"), [
    (dict(counts=torch.zeros(4, dtype=torch.int64)), "counts", "expected dtype"),
    (dict(counts=None), "counts", "torch.Tensor"),
    (dict(n=1 << 31), "n", "does not fit"),
    (dict(u=-1), "u", "does not fit"),
    (dict(big=1.5), "big", "an integer"),
])
def test_a_field_is_checked_as_a_parameter_of_its_type(change, field, message):
    with pytest.raises(ChunkringUsageError, match=message) as info:
        toy(**change).pack(CPU)
    assert info.value.field == field


def test_every_field_is_named_once():
    with pytest.raises(ChunkringUsageError, match=r"ToyArgs\(counts, maybe, n, big, u, word\): missing \['n'\], "
                                                  r"unknown \['m'\]") as info:
        ToyArgs(counts=None, maybe=None, m=1, big=0, u=0, word=0)
    assert info.value.field == "args"


def test_a_struct_parameter_takes_its_own_mirror_by_value():
    (params,) = parse_kernels('extern "C" __global__ void k(const __grid_constant__ ToyArgs args) {}').values()
    assert params == (Param("args", "struct", struct="ToyArgs"),)
    args = toy()
    assert params[0].convert(args, CPU) == args.pack(CPU)

    class OtherArgs(ArgStruct):
        FIELDS = "int n"

    for wrong in (OtherArgs(n=1), toy().values, None):
        with pytest.raises(ChunkringUsageError, match="expected a ToyArgs") as info:
            params[0].convert(wrong, CPU)
        assert info.value.field == "args"
    with pytest.raises(ChunkringUsageError, match="names its struct"):
        Param("args", "struct")
    with pytest.raises(ChunkringUsageError, match="names its struct"):
        Param("n", "i32", struct="ToyArgs")


@pytest.mark.parametrize("signature", ["ToyArgs args", "const ToyArgs args", "__grid_constant__ ToyArgs args",
                                       "CHUNKRING_NULLABLE const __grid_constant__ ToyArgs args"])
def test_a_struct_is_taken_only_as_const_grid_constant(signature):
    with pytest.raises(ChunkringRuntimeError, match="an argument struct is taken by value"):
        parse_kernels(f'extern "C" __global__ void k({signature}) {{}}')


@pytest.mark.parametrize(("name", "fields"), [
    ("MapArgs", "const __grid_constant__ TensorMap map"),
    ("TwiceArgs", "int n, long long n"),
    ("HeadArgs", "int version"),
    ("Loose", "int n"),
])
def test_a_mirror_is_named_FooArgs_and_holds_pointers_and_integers_once(name, fields):
    with pytest.raises(ChunkringRuntimeError, match="an argument struct is named FooArgs"):
        type(name, (ArgStruct,), {"FIELDS": fields})


def test_a_field_of_an_unknown_type_is_refused_with_its_struct():
    with pytest.raises(ChunkringRuntimeError, match="BadArgs.FIELDS.*double"):
        type("BadArgs", (ArgStruct,), {"FIELDS": "double x"})


def header_text(header: str) -> str:
    return (DEVICE / "include" / header).read_text()


@pytest.mark.parametrize("name", sorted(MIRRORS))
def test_every_mirror_is_its_header_struct(name):
    header, mirror = MIRRORS[name]
    assert header_structs(header)[name] == list(mirror.names)  # every word, in order: offset 8 i
    text = header_text(header)
    size = re.search(rf"sizeof\({name}\) == (\d+) \* sizeof\(u64\)", text)
    assert size and int(size.group(1)) == len(mirror.names) == mirror.nbytes // 8
    body = re.search(rf"struct {name} \{{(.*?)\n\}};", text, re.S).group(1)
    comments = dict(re.findall(r"^\s*u64 (\w+);\s*//\s*([^:\n]+?)\s*(?::.*)?$", body, re.M))
    assert (comments.pop("version"), comments.pop("bytes")) == ("kKernelArgsVersion", f"sizeof({name})")
    assert {f: parse_params(f"{ctype} {f}", header)[0] for f, ctype in comments.items()} \
        == {field.name: field for field in mirror.fields}


@pytest.mark.parametrize("header", sorted(HEADERS))
def test_every_header_struct_has_a_mirror(header):
    assert set(header_structs(header)) == {name for name, (home, _) in MIRRORS.items() if home == header}


def test_the_version_is_the_headers():
    assert header_constant("chunkring/layout/kernel_args.cuh", "kKernelArgsVersion") == KERNEL_ARGS_VERSION


def test_every_field_is_read_as_its_mirror_types_it():
    """The code that reads a struct (its kernels, and the functions of their sources that take it by reference) reads
    every field, each as the type the mirror converts it as, and only through arg<T>; a kernel checks the struct's
    version and size (require_args) before it reads anything of it."""
    code = struct_code()
    assert set(code) == set(MIRRORS), "every mirror is some kernel's, every kernel's struct mirrored"
    kernels = {kernel for name in code for kernel in code[name]} & set(kernel_bodies())
    for name, readers in code.items():
        declared = {field.name: field for field in MIRRORS[name][1].fields}
        read = set()
        for where, body in readers.items():
            reads = field_reads(body)
            for field, ctype in reads:
                got = parse_params(f"{ctype} {field}", where)[0]
                assert (got.kind, got.dtype) == (declared[field].kind, declared[field].dtype), \
                    f"{where} reads {name}.{field} as {ctype}"
                read.add(field)
            assert len(re.findall(r"\bargs\.", body)) == len(reads), f"{where}: a word read without arg<T>"
            if where in kernels:
                first = re.search(r"\bargs\b", body)
                assert first and body[first.start():].startswith("args);") and "require_args(args);" in body, where
        assert read == declared.keys(), f"{name}: never read: {sorted(declared.keys() - read)}"


def test_no_kernel_takes_ten_or_more_loose_parameters():
    over = {}
    for source in kernel_sources():
        for kernel, params in parse_kernels((KERNEL_DIR / f"{source}.cu").read_text(), source).items():
            loose = [p for p in params if not p.struct]
            if len(loose) > LOOSE_LIMIT:
                over[kernel] = len(loose)
    assert over.keys() == LOOSE.keys(), over
