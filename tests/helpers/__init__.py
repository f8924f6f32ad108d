"""Plain helpers that test modules of several folders share - no tests and no fixtures here (fixtures live in
the conftest.py files). A test module never imports another test module: what two of them need lives here,
in tests/gpu's helper modules, or in chunkring.testing when a benchmark could use it too
(tests/unit/test_test_hygiene.py enforces it)."""
