"""Every environment variable chunkring reads or sets, in one place.

Our own knobs live under the ``CHUNKRING_`` prefix. The multicast variables are not knobs: NVLink
multicast must stay off on every machine we run on (a program using it can take a shared host's GPUs
out of service), so we set them and refuse to run if someone set them otherwise.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

from chunkring.errors import ChunkringUsageError

__all__ = [
    "EAGER_LOADING",
    "MULTICAST_OFF",
    "apply_process_defaults",
    "module_loading_is_eager",
    "transport_mode",
    "cache_dir",
    "cache_root",
    "check_timeout_s",
    "check_work_queues",
    "watchdog_timeout_s",
]

#: Variables that keep NVLink multicast (NVLS) off in NVSHMEM, NCCL and torch symmetric memory.
MULTICAST_OFF = {
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}

#: Load every kernel when CUDA initialises. Under lazy loading (CUDA's default) a kernel's first launch
#: loads its module, and that load may wait for the kernels already running; chunkring's producers and
#: consumers spin on each other, so a first launch of any kernel (ours or torch's) beside a spinning one
#: can deadlock until the watchdog fires (seen on the H200). CUDA reads this once, when it initialises.
EAGER_LOADING = {"CUDA_MODULE_LOADING": "EAGER"}

#: Defaults for a job whose ranks all sit on one node: no network transport, no NCCL inside NVSHMEM,
#: and the UID bootstrap on loopback (the isolated GPU host has no other interface worth trying).
SINGLE_NODE_DEFAULTS = {
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_DISABLE_NCCL": "1",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
}


def apply_process_defaults(environ: MutableMapping[str, str] | None = None, *,
                           single_node: bool) -> MutableMapping[str, str]:
    """Force multicast off and fill single-node defaults; returns ``environ`` (``os.environ`` by default).

    Raises ``ChunkringUsageError`` if a multicast variable was set to a value that turns multicast on.
    Must run before NVSHMEM, NCCL or torch symmetric memory initialise (they read these once).
    """
    env = os.environ if environ is None else environ
    for name, value in MULTICAST_OFF.items():
        if env.get(name, value) != value:
            raise ChunkringUsageError(
                f"NVLink multicast must stay off: expected {name}={value}, found {env[name]!r}", field=name
            )
        env[name] = value
    if single_node:
        for name, value in SINGLE_NODE_DEFAULTS.items():
            env.setdefault(name, value)
    return env


def cache_root() -> Path:
    """The folder of chunkring's caches (``CHUNKRING_CACHE_DIR``, default ``~/.cache/chunkring``)."""
    return Path(os.environ.get("CHUNKRING_CACHE_DIR") or Path.home() / ".cache" / "chunkring")


def cache_dir() -> Path:
    """Where compiled kernels are cached: :func:`cache_root`'s ``kernels``."""
    return cache_root() / "kernels"


def watchdog_timeout_s() -> float:
    """Seconds a device spin-wait may last before it reports who is stuck (``CHUNKRING_TIMEOUT_S``, 100)."""
    raw = os.environ.get("CHUNKRING_TIMEOUT_S", "100")
    try:
        value = float(raw)
    except ValueError:
        raise ChunkringUsageError(f"not a number: {raw!r}", field="CHUNKRING_TIMEOUT_S") from None
    return check_timeout_s(value, field="CHUNKRING_TIMEOUT_S")


def check_timeout_s(value: float, *, field: str) -> float:
    """A watchdog limit must be positive and at most a day (its nanoseconds must fit the descriptor)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 24 * 3600:
        raise ChunkringUsageError(f"must be in (0, 86400] seconds, got {value!r}", field=field)
    return float(value)


def transport_mode() -> str:
    """How rings reach their peers' buffers unless told (``CHUNKRING_TRANSPORT``: ``auto``, the default, uses
    loads and stores where NVSHMEM maps a peer and RMA elsewhere; ``rma`` uses RMA for every peer)."""
    raw = os.environ.get("CHUNKRING_TRANSPORT", "auto")
    if raw not in ("auto", "rma"):  # chunkring.ring.transport.TRANSPORT_MODES
        raise ChunkringUsageError(f"must be 'auto' or 'rma', got {raw!r}", field="CHUNKRING_TRANSPORT")
    return raw


def check_work_queues() -> None:
    """Refuse ``CUDA_DEVICE_MAX_CONNECTIONS=1``: one hardware work queue serialises every stream of the
    process, so a producer queued behind a spinning consumer never runs (a producer starved on the H200,
    even with the SMs split between them). Every ring spins on its peers, so every ring needs more."""
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise ChunkringUsageError("CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream in one hardware queue, where a "
                                  "producer waits behind a spinning consumer forever; unset it (the default is 8)",
                                  field="CUDA_DEVICE_MAX_CONNECTIONS")


def module_loading_is_eager() -> bool:
    """Whether this process's CUDA driver loads modules eagerly (see ``EAGER_LOADING``)."""
    from cuda.bindings import driver

    err, mode = driver.cuModuleGetLoadingMode()
    if err != driver.CUresult.CUDA_SUCCESS:
        from chunkring.errors import ChunkringRuntimeError

        raise ChunkringRuntimeError(f"cuModuleGetLoadingMode failed: {err}")
    return mode == driver.CUmoduleLoadingMode.CU_MODULE_EAGER_LOADING


def mps_enabled(ordinal: int) -> bool:
    """Whether contexts on GPU ``ordinal`` are shared through MPS (``CU_DEVICE_ATTRIBUTE_MPS_ENABLED``)."""
    from cuda.bindings import driver

    err, value = driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MPS_ENABLED, ordinal)
    if err != driver.CUresult.CUDA_SUCCESS:
        from chunkring.errors import ChunkringRuntimeError

        raise ChunkringRuntimeError(f"cuDeviceGetAttribute(MPS_ENABLED) failed: {err}")
    return bool(value)
