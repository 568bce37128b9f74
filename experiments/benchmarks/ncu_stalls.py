"""Where a kernel's warps wait, per SASS instruction, from an Nsight Compute source page exported as CSV.

    ncu --kernel-name regex:NAME --launch-skip 3 --launch-count 1 --section SourceCounters -o rep python3 ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python3 experiments/benchmarks/ncu_stalls.py rep.csv [--top 25] [--context 6] [--json out.json]

Prints the instructions holding the most warp-stall samples with the instructions around them, and resolves a
sampled branch's target: a `SYNCS.PHASECHK.TRANS64.TRYWAIT` followed by `@!P BRA` is an mbarrier wait loop, so
its samples are time spent waiting on that barrier (a TMA load landing, a consumer releasing a buffer), which
ncu files under "long scoreboard". Runs without a GPU (the CSV is plain text).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_source_csv(path: str) -> list[dict]:
    """Rows of the CSV's instruction table: address, sass, samples, executed (ints; '' counts as 0)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next((i for i, r in enumerate(rows) if "Address" in r and "Source" in r), None)
    if header_at is None:
        raise ValueError(f"{path}: no 'Address' / 'Source' header row: not an ncu --page source --csv export")
    header = rows[header_at]
    missing = [c for c in (SAMPLES, EXECUTED) if c not in header]
    if missing:
        raise ValueError(f"{path}: columns {missing} are missing (profile with --section SourceCounters)")
    col = {name: header.index(name) for name in ("Address", "Source", SAMPLES, EXECUTED)}

    def count(v: str) -> int:
        v = v.replace(",", "").strip()
        return int(float(v)) if v not in ("", "-") else 0

    return [{"index": i, "address": r[col["Address"]], "sass": r[col["Source"]].strip(), "samples": count(r[col[SAMPLES]]),
             "executed": count(r[col[EXECUTED]])}
            for i, r in enumerate(rows[header_at + 1:]) if len(r) > max(col.values())]


def barrier_wait_branches(instrs: list[dict]) -> set[int]:
    """Indices of `@!P BRA` instructions that loop on the mbarrier try-wait just before them."""
    waits = set()
    for i, ins in enumerate(instrs):
        m = re.match(r"@!(U?P\d+)\s+BRA\b", ins["sass"])
        if not m:
            continue
        for j in range(i - 1, max(i - 4, -1), -1):
            prev = instrs[j]["sass"]
            if "SYNCS.PHASECHK" in prev and re.search(rf"\b{m.group(1)}\b", prev):
                waits.add(i)
                break
    return waits


def summarize(instrs: list[dict], top: int) -> dict:
    total = sum(i["samples"] for i in instrs)
    waits = barrier_wait_branches(instrs)
    ranked = sorted(instrs, key=lambda i: -i["samples"])[:top]
    return {
        "total_samples": total,
        "instructions": len(instrs),
        "barrier_wait_samples": sum(instrs[i]["samples"] for i in waits),
        "top": [{**i, "share": i["samples"] / total if total else 0.0, "barrier_wait": i["index"] in waits}
                for i in ranked],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="ncu -i REP --page source --csv --print-source sass output")
    p.add_argument("--top", type=int, default=25, help="instructions listed, most samples first (default %(default)s)")
    p.add_argument("--context", type=int, default=0, help="instructions shown before each listed one (default %(default)s)")
    p.add_argument("--json", default="", help="also write the summary here")
    a = p.parse_args(argv)
    instrs = read_source_csv(a.csv)
    s = summarize(instrs, a.top)
    tot = s["total_samples"] or 1
    print(f"{s['total_samples']} stall samples over {s['instructions']} instructions; "
          f"{100 * s['barrier_wait_samples'] / tot:.1f} % in mbarrier wait loops")
    for t in s["top"]:
        tag = "  <- mbarrier wait" if t["barrier_wait"] else ""
        if a.context:
            for c in instrs[max(0, t["index"] - a.context):t["index"]]:
                print(f"        {c['index']:5d} {c['samples']:6d} {c['sass']}")
        print(f"{100 * t['share']:5.1f} % {t['index']:5d} {t['samples']:6d} x{t['executed']:<8d} {t['sass']}{tag}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
