// Annotations on the parameters of `extern "C" __global__` kernels. Every kernel source includes this
// header. The signature in the .cu is the only declaration of a kernel's parameters: the host reads it
// (runtime/chunkring/jit/signatures.py) to check each launch. To the compiler the annotations are empty.
#pragma once

// A pointer parameter that may be null: the launch accepts None for it (the kernel must test it).
#define CHUNKRING_NULLABLE
