// Kernel argument structs: a kernel of ten or more parameters takes them as one struct by value,
// `const __grid_constant__ FooArgs args` - the launch writes it into the kernel's parameter space and the kernel reads
// it there (__grid_constant__: never copied to local memory). A struct is 64-bit words: `version`
// (kKernelArgsVersion) and `bytes` (its sizeof) first, which require_args checks before anything else is read, then
// one word per field - a pointer's address, or an integer sign- or zero-extended - which the kernel reads as its
// type with arg<T>(args.field). Each struct is mirrored on the host by a chunkring.jit.ArgStruct subclass of the same
// name (runtime/chunkring/jit/signatures.py) that declares the fields in this order with the types the kernel reads;
// tests/unit/test_kernel_args.py holds the two against each other, tests/compile/test_kernel_args_layout.py the
// offsets NVRTC gives them.
#pragma once

#include <cuda/std/cstdint>
#include <cuda/std/type_traits>

namespace chunkring::layout {

using u64 = ::cuda::std::uint64_t;

constexpr u64 kKernelArgsVersion = 1;  // == runtime/chunkring/jit/signatures.py KERNEL_ARGS_VERSION

// A field's word as the type the kernel reads: a pointer (the word is its address) or an integer (its low bits).
template <typename T>
__device__ __forceinline__ T arg(u64 word) {
    if constexpr (::cuda::std::is_pointer<T>::value) {
        return reinterpret_cast<T>(word);
    } else {
        return static_cast<T>(word);
    }
}

// A struct the host built by another layout - host and device halves from different trees - traps: no field of it
// can be trusted. No printf (the decode kernels keep no stack frame): the host's layout test is where it is caught.
template <typename Args>
__device__ __forceinline__ void require_args(const Args& args) {
    if (args.version != kKernelArgsVersion || args.bytes != sizeof(Args)) __trap();
}

}  // namespace chunkring::layout
