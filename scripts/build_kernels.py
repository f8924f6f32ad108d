"""Compile every kernel source (or load it from the cache) and report the time each took."""

import argparse
import json

from chunkring.jit import build, default_arch, kernel_sources, nvshmem_version


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write {kernel: {seconds, cache_hit, key, arch}} here")
    parser.add_argument("--arch", default=None,
                        help="target, e.g. sm_90 (default: this machine's GPU; sm_90 where there is none)")
    args = parser.parse_args()
    arch = args.arch or default_arch()
    report = {}
    for name in kernel_sources():
        result = build(name, arch=arch)
        report[name] = {"seconds": round(result.seconds, 4), "cache_hit": result.cache_hit, "key": result.cache_key,
                        "arch": result.arch}
        print(f"{name:<24} {'cache' if result.cache_hit else 'compiled':<9} {result.seconds:8.3f} s  "
              f"({result.arch}, NVSHMEM {nvshmem_version()})")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
