"""Print the ring's symmetric bytes per rank beside the batch-ready input region it replaces.

    python scripts/ring_memory.py            # realistic shapes, a few slot and chunk sizes
"""

from chunkring.ring.layout import RingLayout
from chunkring.ring.spec import PayloadFormat, RingSpec

#: (name, world, experts, topk, hidden, max tokens per rank) - the shapes issue 8 benchmarks.
SHAPES = [
    ("V3-like prefill, EP8", 8, 256, 8, 7168, 8192),
    ("V3-like decode, EP8", 8, 256, 8, 7168, 128),
    ("V4-Flash-like prefill, EP8", 8, 256, 6, 4096, 8192),
]
RINGS = [(2, 256), (2, 512), (4, 512), (2, 32)]


def main() -> None:
    print(f"{'shape':<28} {'payload':<8} {'S x T':>9} {'ring MiB':>9} {'full MiB':>9} {'ring/full':>9}")
    for name, world, experts, topk, hidden, max_tokens in SHAPES:
        for payload in PayloadFormat:
            for slots, tokens in RINGS:
                if tokens * slots > max_tokens:
                    continue
                spec = RingSpec(world, slots, tokens, hidden, payload, topk, experts)
                layout = RingLayout(spec)
                full = layout.full_input_bytes(max_tokens)
                print(f"{name:<28} {payload.name:<8} {f'{slots} x {tokens}':>9} {layout.total_bytes / 2**20:9.2f} "
                      f"{full / 2**20:9.2f} {layout.total_bytes / full:9.3f}")


if __name__ == "__main__":
    main()
