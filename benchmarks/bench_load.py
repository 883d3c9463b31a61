"""Load a checkpoint strictly and report load time and resident-memory growth.

Usage: python benchmarks/bench_load.py DIR [--level strict|family|auto]

Run it as its own process (it is one): the baseline is taken after imports, then the checkpoint
is opened and validated and a numpy view is made for every tensor. Loading maps the shards
without reading them, so RSS should grow by megabytes (page tables, the parsed headers), not by
the size of the weights.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from lily.checkpoint.loader import load_checkpoint

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--level", default="strict", choices=("strict", "family", "auto"))
    args = parser.parse_args()

    before = rss_bytes()
    start = time.perf_counter()
    checkpoint = load_checkpoint(args.directory, level=args.level)
    opened = time.perf_counter()
    views = [checkpoint.tensors[name] for name in checkpoint.tensors]
    done = time.perf_counter()
    after = rss_bytes()

    weight_bytes = sum(view.nbytes for view in views)
    mapped_bytes = sum(shard.size for shard in checkpoint.shards.values())
    print(f"checkpoint      {args.directory} ({checkpoint.level})")
    print(f"tensors         {len(views)} in {len(checkpoint.shards)} shards")
    print(f"weights         {weight_bytes / 1e9:.3f} GB (mapped {mapped_bytes / 1e9:.3f} GB)")
    print(f"open+validate   {(opened - start) * 1e3:.1f} ms")
    print(f"views           {(done - opened) * 1e3:.1f} ms")
    print(f"load total      {(done - start) * 1e3:.1f} ms")
    print(f"RSS before      {before / 1e6:.1f} MB")
    print(f"RSS after       {after / 1e6:.1f} MB")
    print(f"RSS growth      {(after - before) / 1e6:.1f} MB")
    print(f"peak RSS        {peak_rss_bytes() / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
