"""The kernel argument structs' layout as NVRTC compiles it (no GPU): every word of every struct sits at the offset its
host mirror (chunkring.jit.ArgStruct) packs it at, and the struct is the mirror's size - checked by static_asserts the
compiler itself evaluates over the headers (device/include/chunkring/.../kernel_args.cuh), so a padding or type change
the regex-level test (tests/unit/test_kernel_args.py) could miss fails here."""

import dataclasses

from chunkring.jit.compiler import program_options
from tests.helpers.kernel_args import HEADERS, mirrors


def layout_source() -> str:
    """A translation unit of static_asserts: offsetof(S, word) == 8 i (__builtin_offsetof: libcu++'s offsetof is no
    constant expression under NVRTC) and sizeof(S) == nbytes, for every mirror."""
    lines = [f'#include "{header}"' for header in sorted(HEADERS)]
    for name, (header, mirror) in sorted(mirrors().items()):
        struct = f"{HEADERS[header][0]}::{name}"
        lines += [f'static_assert(__builtin_offsetof({struct}, {word}) == {8 * i}, "{name}.{word}");'
                  for i, word in enumerate(mirror.names)]
        lines.append(f'static_assert(sizeof({struct}) == {mirror.nbytes}, "sizeof({name})");')
    return "\n".join(lines) + "\n"


def test_every_word_is_where_its_mirror_packs_it():
    from cuda.bindings import nvrtc

    options = program_options("moe_experts", arch="sm_90")  # the kernels' include paths and language options
    options = dataclasses.replace(options, arch="compute_90", ptxas_options=None)
    flags = options.as_bytes("nvrtc")
    source = layout_source()
    assert source.count("static_assert") > 40  # every mirror's words
    err, program = nvrtc.nvrtcCreateProgram(source.encode(), b"kernel_args_layout.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    try:
        (err,) = nvrtc.nvrtcCompileProgram(program, len(flags), flags)
        _, size = nvrtc.nvrtcGetProgramLogSize(program)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(program, log)
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
