"""A kernel library that launches nothing, for the host-side tests of the expert GEMMs' launchers
(tests/unit/test_moe_decode_host.py, test_moe_persistent_host.py): :class:`RecordingLibrary` checks each launch as
chunkring.jit's KernelLibrary checks it and records it; :func:`small_weights` draws FP8 experts on the CPU."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from chunkring.jit import parse_kernels
from chunkring.jit.launch import check_argument_names
from chunkring.moe.weights import Fp8Weight, quantize_weight_fp8

__all__ = ["H100", "RecordingLibrary", "small_weights"]

KERNEL_DIR = Path(__file__).resolve().parents[2] / "device" / "kernels"
#: The device properties a launcher reads, an H100's: its SMs, the shared memory a block may opt in to.
H100 = dict(multiprocessor_count=132, max_shared_memory_per_block_optin=232448)


class RecordingLibrary:
    """A KernelLibrary stand-in on an H100's figures (``runtime``, on the CPU): checks each launch against the kernels
    parsed from ``device/kernels/<source>.cu`` (every parameter named once, each value of the kind its C type takes:
    each tensor's dtype and contiguity, each integer's range) and records it in ``launches``: its arguments, with its
    ``name``, ``grid``, ``block``, ``shared_bytes`` and ``pdl``."""

    def __init__(self, source: str) -> None:
        self.signatures = parse_kernels((KERNEL_DIR / f"{source}.cu").read_text(), f"{source}.cu")
        self.runtime = SimpleNamespace(device=SimpleNamespace(properties=SimpleNamespace(**H100)),
                                       torch_device=torch.device("cpu"))
        self.launches: list[dict[str, Any]] = []

    def launch(self, name: str, /, *, grid: Any, block: Any, stream: Any, shared_bytes: int = 0, pdl: bool = False,
               **args: Any) -> None:
        params = self.signatures[name]
        check_argument_names(name, params, args)
        for param in params:
            param.convert(args[param.name], torch.device("cpu"))
        self.launches.append(dict(args, name=name, grid=grid, block=block, shared_bytes=shared_bytes, pdl=pdl))


def small_weights(E: int, H: int, inter: int) -> tuple[Fp8Weight, Fp8Weight]:
    """Random w13 [E, 2 inter, H] and w2 [E, H, inter], quantised to FP8 on the CPU."""
    return quantize_weight_fp8(torch.randn(E, 2 * inter, H)), quantize_weight_fp8(torch.randn(E, H, inter))
