"""Where a kernel's warps wait, by region of its SASS, from an ncu source page; no GPU needed.

    python tools/ncu_regions.py SASS.csv            # regions by execution count
    python tools/ncu_regions.py SASS.csv --runs N   # the runs of code executed N times
    python tools/ncu_regions.py SASS.csv --json

SASS.csv is what `ncu -i REPORT --page source --print-source sass --csv` prints for one
profiled kernel (a report of `--set full`, whose source counters sample warp stalls). Each
row is one SASS instruction: how many times a warp executed it and how many warp samples
found a warp stopped there, split by reason (stall_long_sb, stall_barrier, stall_no_inst,
...).

Why by execution count. In the persistent kernels every instruction of a loop body runs
as often as the loop's iterations, the code a tile runs once as often as the tiles, and the
prologue once a warp: grouping instructions by that count separates the slice loop from a
tile's start and end without reading the code (docs/fp8.md, "Where the time goes").
`gl.warp_specialize` compiles each partition's code apart, so two partitions with the same
role show up as runs of one count at two places; `--runs` lists them with their addresses.

Samples count warps, not time: a warp parked at a barrier is sampled as often as one
issuing, so shares are of the warps' time, and idle partitions weigh in.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import Counter
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Region:
    """Instructions sharing one execution count (or one run of them): how many, their
    samples and the samples by reason (the `stall_` prefix dropped)."""

    executed: int
    instructions: int = 0
    samples: int = 0
    reasons: Counter = field(default_factory=Counter)
    first: str = ""  # address of the first instruction
    last: str = ""

    def add(self, row: Row) -> None:
        self.instructions += 1
        self.samples += row.samples
        self.reasons.update(row.reasons)
        self.first = self.first or row.address
        self.last = row.address

    def as_dict(self, total: int) -> dict:
        return {"executed": self.executed, "instructions": self.instructions,
                "samples": self.samples, "share": self.samples / total if total else 0.0,
                "reasons": dict(self.reasons.most_common()), "first": self.first,
                "last": self.last}


@dataclass
class Row:
    address: str
    source: str
    executed: int
    samples: int
    reasons: dict


def _int(text: str) -> int:
    text = text.replace(",", "").strip()
    return int(text) if text and text != "-" else 0


def read_rows(lines) -> list[Row]:
    """The instructions of the first kernel in an ncu source csv (its first line names the
    kernel, the second holds the column names)."""
    rows = list(csv.reader(lines))
    header = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if header is None:
        raise ValueError("no 'Address' header row: not an ncu --page source --csv output")
    names = rows[header]
    col = {name: i for i, name in enumerate(names)}
    for needed in ("Source", SAMPLES, EXECUTED):
        if needed not in col:
            raise ValueError(f"column {needed!r} missing: profile with --set full")
    reasons = [n for n in names if n.startswith("stall_") and "(Not Issued)" not in n]
    out = []
    for r in rows[header + 1:]:
        if len(r) < len(names) or not r[0].startswith("0x"):
            break  # the next kernel's block, or the end
        out.append(Row(r[0], r[col["Source"]].strip(), _int(r[col[EXECUTED]]),
                       _int(r[col[SAMPLES]]),
                       {n.removeprefix("stall_"): _int(r[col[n]]) for n in reasons
                        if _int(r[col[n]])}))
    return out


def by_count(rows: list[Row]) -> list[Region]:
    """One region per execution count, the most sampled first."""
    regions: dict[int, Region] = {}
    for row in rows:
        regions.setdefault(row.executed, Region(row.executed)).add(row)
    return sorted(regions.values(), key=lambda g: -g.samples)


def runs(rows: list[Row], executed: int, gap: int = 3) -> list[Region]:
    """The stretches of code executed `executed` times, in address order. A stretch runs
    from one such instruction to the last one reached with at most `gap` instructions of
    other counts in a row between two of them (a branch target, a store under a row
    mask), and counts everything in it: a tile's end with its masked reductions is one
    stretch."""
    out: list[Region] = []
    start = last = None
    for i, row in enumerate(rows):
        if row.executed != executed:
            continue
        if last is not None and i - last > gap + 1:
            out.append(_stretch(rows[start:last + 1], executed))
            start = None
        start = i if start is None else start
        last = i
    if start is not None:
        out.append(_stretch(rows[start:last + 1], executed))
    return out


def _stretch(rows: list[Row], executed: int) -> Region:
    region = Region(executed)
    for row in rows:
        region.add(row)
    return region


def _line(g: Region, total: int, top: int = 5) -> str:
    share = 100 * g.samples / total if total else 0.0
    reasons = ", ".join(f"{k} {100 * v / g.samples:.0f}%" for k, v in g.reasons.most_common(top)
                        ) if g.samples else ""
    return (f"{g.executed:>12,} {g.instructions:>7,} {g.samples:>9,} {share:6.1f}%  "
            f"{g.first[-6:]}-{g.last[-6:]}  {reasons}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--runs", type=int, default=None, metavar="N",
                    help="the stretches of code executed N times")
    ap.add_argument("--top", type=int, default=15, help="regions to print")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with open(args.csv, newline="") as f:
        rows = read_rows(f)
    total = sum(r.samples for r in rows)
    regions = runs(rows, args.runs) if args.runs is not None else by_count(rows)[:args.top]
    if args.json:
        json.dump({"samples": total, "regions": [g.as_dict(total) for g in regions]},
                  sys.stdout, indent=1)
        print()
        return 0
    print(f"{len(rows):,} instructions, {total:,} warp samples")
    print(f"{'executed':>12} {'instr':>7} {'samples':>9} {'share':>7}  addresses      reasons")
    for g in regions:
        print(_line(g, total))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
