// The one place that includes NVSHMEM's device headers, compiled header-only by NVRTC (docs/BUILD.md).
#pragma once

// NVSHMEM 3.4.5's headers reach for std:: type traits that NVRTC lacks; lend them libcu++'s.
// (NVSHMEM 3.8 headers need none of this; it is harmless there.)
#include <cuda/std/cstdint>
#include <cuda/std/type_traits>
namespace std {
using ::cuda::std::is_integral;
using ::cuda::std::is_signed;
using ::cuda::std::is_unsigned;
}  // namespace std

#include "non_abi/nvshmem_build_options.h"
// IBGDA device code needs the static device library, which NVRTC cannot link (docs/BUILD.md).
#undef NVSHMEM_IBGDA_SUPPORT

#include <nvshmem.h>
#include <nvshmemx.h>
