"""The MoE layer's engine, private to :mod:`chunkring.moe`: what one call enqueues and on which streams
(:mod:`.schedule`), what a layer holds at one rank (:mod:`.resources`), the call's resolved description and its
checks (:mod:`.call`), the stage its pull writes (:mod:`.stage`), the expert work (:mod:`.experts`, :mod:`.decode`,
:mod:`.blocks`, :mod:`.dispatch`), the fused producer (:mod:`.producer`), the device descriptors
(:mod:`.descriptors`) and the operators' layer handles (:mod:`.handles`).

Nothing outside :mod:`chunkring.moe` imports it but the engine's own tests (tests/unit, tests/gpu) and the two
benchmarks that time its parts alone (benchmarks/bench_decode.py, bench_consumer_breakdown.py):
tests/unit/test_import_graph.py holds that rule. Users, the integrations, the launcher and the other benchmarks use
the public face: :class:`chunkring.MoELayer`, :mod:`chunkring.moe.routing`, :mod:`chunkring.moe.gemm`,
:mod:`chunkring.moe.kernels`, :mod:`chunkring.moe.calibration`.
"""
