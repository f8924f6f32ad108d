"""The kernel argument structs' layout as NVRTC compiles it (no GPU): every word of every struct sits at the offset its
host mirror (chunkring.jit.ArgStruct) packs it at, and the struct is the mirror's size - checked by static_asserts the
compiler itself evaluates over the headers (device/include/chunkring/.../kernel_args.cuh), so a padding or type change
the regex-level test (tests/unit/test_kernel_args.py) could miss fails here."""

from tests.helpers.kernel_args import HEADERS, mirrors
from tests.helpers.nvrtc import nvrtc_ptx, virtual_options


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
    source = layout_source()
    assert source.count("static_assert") > 40  # every mirror's words
    # the kernels' include paths and language options; NVRTC's log names a failed assert
    nvrtc_ptx(source.encode(), "kernel_args_layout.cu", virtual_options("moe_experts"))
