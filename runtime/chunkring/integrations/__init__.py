"""chunkring inside other frameworks' models: :mod:`chunkring.integrations.transformers` swaps the sparse MoE
blocks of a Hugging Face transformers model for chunkring-backed ones.

A layer of its own, above :mod:`chunkring.moe` (whose layer, loader and producers it drives) and below
:mod:`chunkring.testing`; the framework it adapts to is an optional dependency, imported only when an
adapter is called, so ``import chunkring`` never needs it.
"""
