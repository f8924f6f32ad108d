"""Whether this process sees a CUDA GPU: what the root conftest.py skips every ``gpu`` test by, and what the
tests of the no-GPU paths (exit status 3, the doctor's verdict) are skipped by on a machine that has one."""

import chunkring  # noqa: F401  (first: it sets CUDA_MODULE_LOADING before torch initialises CUDA below)


def _gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


HAVE_GPU = _gpu_available()
