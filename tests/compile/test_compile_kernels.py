"""Every kernel source compiles with NVRTC against the NVSHMEM the GPU host runs (no GPU needed: the
target is then the documented CPU fallback, sm_90), and the on-disk cache is keyed so that a changed
input - source, header, macro, any other option, architecture - recompiles and an unchanged one does not."""

import dataclasses
import shutil
import struct
from pathlib import Path

import pytest

from chunkring.env import cache_dir
from chunkring.errors import ChunkringUsageError
from chunkring.jit import arch_of, build, default_arch, kernel_sources, nvshmem_version
from chunkring.jit.compiler import (
    CCCL_VERSION_HEADER,
    CPU_FALLBACK_ARCH,
    KERNEL_DIR,
    cache_key,
    headers_digest,
    include_path,
    program_options,
)
from chunkring.testing.stress import (
    ARRIVE_BEFORE_ROWS,
    MUTANTS,
    NO_HELD_ACK,
    NO_INPUT_CHECKS,
    NO_PUSH_RELEASE,
    SEAL_ON_RESERVE,
)

#: The GPU host's torch 2.11 pins NVSHMEM 3.4.5; compiling against anything else would not prove
#: that the host accepts our kernels.
GPU_HOST_NVSHMEM = "3.4.5"


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CHUNKRING_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kernel-cache"))


def test_headers_are_the_gpu_hosts_nvshmem():
    assert nvshmem_version() == GPU_HOST_NVSHMEM


@pytest.mark.parametrize("name", kernel_sources())
def test_kernel_compiles_and_caches(name):
    first = build(name)
    assert first.object_code.code[:4] == b"\x7fELF"
    second = build(name)
    assert second.cache_hit and second.cache_key == first.cache_key
    assert bytes(second.object_code.code) == bytes(first.object_code.code)


def test_selftest_exports_its_kernels():
    code = bytes(build("selftest").object_code.code)
    for symbol in (b"selftest_ring_pass", b"selftest_pingpong"):
        assert symbol in code


def test_defines_change_the_key():
    assert build("selftest", defines={"CHUNKRING_UNUSED": 1}).cache_key != build("selftest").cache_key


@pytest.mark.parametrize("kwargs,field", [
    ({"name": "nope"}, "name"),
    ({"name": "selftest", "arch": "90"}, "arch"),
    ({"name": "selftest", "defines": {"lower": 1}}, "defines"),
    ({"name": "selftest", "defines": {"X": "a b"}}, "defines"),
])
def test_bad_build_requests(kwargs, field):
    with pytest.raises(ChunkringUsageError) as info:
        build(**kwargs)
    assert info.value.field == field


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_every_protocol_mutant_compiles(mutant):
    # The mutants are the stress suite's negative controls; a mutant that fails to build proves nothing.
    code = bytes(build("ring_stress", defines={"CHUNKRING_MUTANT": MUTANTS[mutant]}).object_code.code)
    assert b"ring_stress" in code and b"litmus_mp" in code and b"litmus_mp_pull" in code


#: Each mutant and every kernel source it reaches (its `if constexpr` is in code that kernel runs): the
#: stress kernels for every protocol mutant, the MoE layer's kernels for the rules they rely on.
MUTANT_KERNELS = [
    *((mutant, "ring_stress") for mutant in sorted(MUTANTS) if mutant != "none"),
    ("no_input_checks", "moe_stream"), ("no_held_ack", "moe_stream"), ("no_push_release", "moe_experts"),
    ("no_ack_release", "moe_stream"), ("no_ack_acquire", "moe_stream"), ("no_arrival_fences", "moe_stream"),
    ("no_arrival_fences", "ring_host_api"), ("no_arrival_fences", "moe_produce"), ("seal_on_reserve", "moe_stream"),
    ("arrive_before_rows", "moe_produce"),
]
_VALUE = {**MUTANTS, "no_input_checks": NO_INPUT_CHECKS, "no_held_ack": NO_HELD_ACK, "no_push_release": NO_PUSH_RELEASE,
          "seal_on_reserve": SEAL_ON_RESERVE, "arrive_before_rows": ARRIVE_BEFORE_ROWS}


def kernel_code(cubin: bytes) -> dict[str, bytes]:
    """The machine code of each kernel in a cubin (ELF64: its ``.text.<kernel>`` sections). The whole file
    differs with any macro, used or not, so only the code says whether a mutant reached a kernel."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def section(i):  # name offset, file offset, size
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
        return name, offset, size

    names = section(shstrndx)[1]
    code = {}
    for i in range(shnum):
        name, offset, size = section(i)
        title = cubin[names + name:cubin.index(b"\0", names + name)].decode()
        if title.startswith(".text."):
            code[title] = cubin[offset:offset + size]
    return code


def test_an_unused_mutant_leaves_the_code_alone():
    # the control for the test below: moe_experts reads only kNoPushRelease
    real = kernel_code(bytes(build("moe_experts").object_code.code))
    assert ".text.moe_combine_push" in real
    assert kernel_code(bytes(build("moe_experts", defines={"CHUNKRING_MUTANT": MUTANTS["no_ack_release"]})
                             .object_code.code)) == real


@pytest.mark.parametrize("mutant,kernel", MUTANT_KERNELS)
def test_each_mutant_builds_a_different_kernel(mutant, kernel):
    # A mutant that compiles to the real kernel's code would make its negative control prove nothing.
    real = kernel_code(bytes(build(kernel).object_code.code))
    broken = kernel_code(bytes(build(kernel, defines={"CHUNKRING_MUTANT": _VALUE[mutant]}).object_code.code))
    assert broken.keys() == real.keys() and broken != real


def test_the_key_covers_the_architecture_and_every_option():
    source = (KERNEL_DIR / "selftest.cu").read_text()
    options = program_options("selftest", arch="sm_90")
    key = cache_key("selftest", source, options)
    assert cache_key("selftest", source, program_options("selftest", arch="sm_90")) == key
    assert cache_key("selftest", source, program_options("selftest", arch="sm_100")) != key
    assert cache_key("selftest", source, dataclasses.replace(options, lineinfo=True)) != key  # not a macro


def test_the_key_covers_the_cuda_headers_beside_ours(tmp_path):
    """A CUDA runtime header (cuda_bf16.h, ...) or a CCCL release changes the key: NVRTC compiles them in."""
    ours, nvshmem, cccl, cudart = include_path()

    def copies(name: str, changed: Path | None) -> tuple[str, ...]:
        """The CUDA runtime's top-level headers and CCCL's version header copied, ``changed`` (relative to the
        copies' folder) edited."""
        copy_cudart, copy_cccl = tmp_path / name / "cudart", tmp_path / name / "cccl"
        shutil.copytree(cudart, copy_cudart, ignore=lambda folder, names: [n for n in names
                                                                          if (Path(folder) / n).is_dir()])
        (copy_cccl / CCCL_VERSION_HEADER).parent.mkdir(parents=True)
        shutil.copy(Path(cccl) / CCCL_VERSION_HEADER, copy_cccl / CCCL_VERSION_HEADER)
        if changed is not None:
            with (tmp_path / name / changed).open("a") as header:
                header.write("// changed\n")
        return ours, nvshmem, str(copy_cccl), str(copy_cudart)

    same = headers_digest(copies("same", None))
    assert same == headers_digest((ours, nvshmem, cccl, cudart))  # the copies hash as the originals
    runtime_changed = headers_digest(copies("runtime", Path("cudart/cuda_bf16.h")))
    cccl_changed = headers_digest(copies("cccl", "cccl" / CCCL_VERSION_HEADER))
    assert len({same, runtime_changed, cccl_changed}) == 3


def test_cached_cubins_are_readable_by_others_and_an_unreadable_one_is_rebuilt(monkeypatch):
    first = build("selftest")
    cubin = next(p for p in cache_dir().glob("selftest-*.cubin") if first.cache_key in p.name)
    assert cubin.stat().st_mode & 0o777 == 0o644  # a shared cache directory serves every user
    real_read = Path.read_bytes

    def unreadable(path):
        if path == cubin:
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(path)

    monkeypatch.setattr(Path, "read_bytes", unreadable)
    again = build("selftest")
    assert not again.cache_hit and again.object_code.code[:4] == b"\x7fELF"


def test_the_target_is_the_gpus_own_or_the_cpu_fallback(monkeypatch):
    import cuda.core

    class Hopper:
        compute_capability = (9, 0)

    class Blackwell:
        compute_capability = (10, 0)

    def no_gpu():
        raise RuntimeError("no NVIDIA driver")

    monkeypatch.setattr(cuda.core, "Device", Blackwell)
    assert default_arch() == "sm_100"
    assert arch_of(Hopper()) == "sm_90"
    monkeypatch.setattr(cuda.core, "Device", no_gpu)
    assert default_arch() == CPU_FALLBACK_ARCH == "sm_90"
    assert build("selftest").arch == CPU_FALLBACK_ARCH


def test_the_doctors_build_check_compiles_where_a_gpu_would_run_it():
    """`chunkring-launch doctor` builds the selftest kernel when the driver shows a GPU (here: told so); on a CPU
    machine it checks NVRTC and the headers only (tests/unit/test_launcher.py)."""
    from chunkring_launch.doctor import check_compiler

    check = check_compiler(gpu=True)
    assert check.status == "PASS" and check.detail.startswith("selftest "), check
