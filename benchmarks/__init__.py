"""chunkring.benchmarks: how chunkring's performance is measured, importing only the library (``chunkring``,
``chunkring.testing``), never the launcher.

* :mod:`~chunkring.benchmarks.bench_moe`: the MoE layer end to end, batch-ready against streamed beside
  the overlap bound and a plain-torch peer; run it with ``chunkring-launch bench`` (the launcher's
  ``bench`` job is its thin entry point: config, layer, progress, report).
* :mod:`~chunkring.benchmarks.peer_moe`: that peer, the same math written the plain-torch way.
* Scripts run directly (``python benchmarks/NAME.py``, under ``mpirun`` for several ranks):
  ``bench_ring_latency.py``, ``bench_input_checks.py``, ``bench_overlap.py`` (streamed against batch-ready
  and the overlap bound, on the default partition; issue 19 item 5); they write :mod:`~chunkring.benchmarks.result_file`
  JSON into ``benchmarks/results/`` (README.md there reads them). ``scripts/bench.sh`` runs the matrix.
"""
