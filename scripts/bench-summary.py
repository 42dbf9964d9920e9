#!/usr/bin/env python3
"""Markdown summary of a pytest-benchmark JSON file (make bench)."""

import json
import sys

data = json.load(open(sys.argv[1]))
print(
    f"# Benchmarks ({data.get('datetime', '')}, {data.get('machine_info', {}).get('cpu', {}).get('brand_raw', '')})\n"
)
print("| benchmark | mean | min | max | rounds | extra |")
print("|---|---|---|---|---|---|")
for b in data.get("benchmarks", []):
    s = b["stats"]
    extra = ", ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in b.get("extra_info", {}).items()
    )
    print(
        f"| {b['fullname']} | {s['mean'] * 1e3:.2f} ms | {s['min'] * 1e3:.2f} ms | {s['max'] * 1e3:.2f} ms "
        f"| {s['rounds']} | {extra} |"
    )

# the KV integrity digests' overhead (bench/test_integrity_overhead.py), measured as ratios in one run
for b in data.get("benchmarks", []):
    x = b.get("extra_info", {})
    if "torch_ratio" in x:
        print(
            f"\nKV integrity digest overhead: {x['digest']} {x['digest_us_per_mib']:.0f} us/MiB, "
            f"{x['torch_digest']} {x['torch_us_per_mib']:.0f} us/MiB, copy {x['copy_us_per_mib']:.0f} us/MiB; "
            f"overhead ratio digest/copy: {x['ratio']:.1f} ({x['digest']}), {x['torch_ratio']:.1f} (torch); "
            f"torch/{x['digest']}: {x['torch_vs_sha256']:.2f}"
        )
