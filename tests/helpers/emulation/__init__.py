"""The CPU emulation of the project's CUDA kernels, run as written by the tests/unit/test_*_emulation.py modules.

machine.py is the machine: global memory as the bytes of the launched torch tensors, every access checked (in
bounds, aligned, never an unwritten byte, never one byte stored twice in a launch; atomics share words), the number
formats and MMA fragments, and a stand-in library that checks each launch against the kernels' signatures. ring.py
holds ranks' symmetric heaps in one process and runs thread blocks as coroutines interleaved by a seed; a wait that
cannot be satisfied yields, and when nothing can progress it fails with EmulatedWaitBlocks. The kernels' emulators
(decode, plan, waves, pull, local_plan, produce, blocks) mirror their device functions line by line, reading
descriptors word by word in the headers' order; pull_reference.py and plan_layout.py say what memory must hold
afterwards.

It is sequentially consistent, so it checks the protocols' logic and the kernels' addressing. Only a GPU shows
memory ordering (fences, acquire/release), timing and real timeouts (ring.py's Clock only orders deadlines), the
tensor core's summation order, the network proxy's real completion of RMA operations (rma.py models when NVSHMEM
promises it) and the timeline trace."""
