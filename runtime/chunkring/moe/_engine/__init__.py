"""The MoE layer's engine, private to :mod:`chunkring.moe`: what one call enqueues and on which streams
(:mod:`.schedule`), eager calls replayed from CUDA graphs (:mod:`.replay`), what a layer holds at one rank
(:mod:`.resources`), the call's resolved description and its checks (:mod:`.call`), the stage its pull writes
(:mod:`.stage`), the expert work (:mod:`.experts`, :mod:`.decode`, :mod:`.blocks`; :mod:`.persistent`, the
persistent decode consumer, not yet called by the layer), the fused producer (:mod:`.producer`), the device
descriptors (:mod:`.descriptors`), the kernels' argument structs (:mod:`.kernel_args`)
and the operators' layer handles (:mod:`.handles`).

Nothing outside :mod:`chunkring.moe` imports it but the engine's own tests (tests/unit, tests/gpu) and the benchmarks
that time one of its parts alone (tests/helpers/source_tree.py, ``ENGINE_BENCHMARKS``, names each):
tests/unit/test_import_graph.py holds that rule. Users, the integrations, the launcher and the other benchmarks use
the public face: :class:`chunkring.MoELayer`, :mod:`chunkring.moe.routing`, :mod:`chunkring.moe.gemm`,
:mod:`chunkring.moe.kernels`, :mod:`chunkring.moe.calibration`.
"""
