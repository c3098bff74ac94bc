"""tools/ncu_regions.py on a hand-built ncu source page: sums checked by hand."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import ncu_regions as nr

COLUMNS = ["Address", "Source", "Warp Stall Sampling (All Samples)",
           "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed",
           "stall_barrier", "stall_long_sb", "stall_no_inst", "stall_lg",
           "stall_long_sb (Not Issued)"]

# (executed, samples by reason: barrier, long_sb, no_inst, lg). A prologue run once by 8
# warps, a tile start run 40 times, a loop body 800 times (with a branch target of another
# count inside), a tile end run 40 times with masked reductions of other counts between
# its instructions, and a barrier where idle warps wait.
CODE = [
    (8, (0, 1, 2, 0)), (8, (0, 0, 1, 0)),
    (40, (0, 2, 10, 0)), (40, (0, 1, 6, 0)),
    (800, (0, 3, 1, 0)), (801, (0, 0, 0, 0)), (800, (2, 5, 0, 0)), (800, (0, 4, 3, 0)),
    (40, (0, 7, 1, 0)), (37, (0, 0, 0, 9)), (38, (0, 1, 0, 8)), (40, (0, 2, 2, 1)),
    (16, (30, 0, 0, 0)),
]


def page(code=CODE, kernel="_k") -> str:
    out = io.StringIO()
    out.write(f'"Kernel Name","{kernel}",\n')
    out.write(",".join(f'"{c}"' for c in COLUMNS) + "\n")
    for i, (executed, reasons) in enumerate(code):
        row = [f"0x7f00{0x10 * i:04x}", f"  OP{i} R1, R2", str(sum(reasons)), "0",
               str(executed), *map(str, reasons), str(reasons[1])]
        out.write(",".join(f'"{v}"' for v in row) + "\n")
    return out.getvalue()


def rows():
    return nr.read_rows(io.StringIO(page()))


def test_read_rows_takes_counts_and_reasons():
    got = rows()
    assert len(got) == len(CODE)
    assert [r.executed for r in got] == [e for e, _ in CODE]
    assert got[0].samples == 3 and got[0].reasons == {"long_sb": 1, "no_inst": 2}
    assert got[9].reasons == {"lg": 9}  # not-issued columns are not reasons
    assert got[-1].address == "0x7f0000c0" and got[0].source == "OP0 R1, R2"


def test_regions_by_execution_count():
    regions = {g.executed: g for g in nr.by_count(rows())}
    loop, tile = regions[800], regions[40]
    assert (loop.instructions, loop.samples) == (3, 18)
    assert loop.reasons == {"barrier": 2, "long_sb": 12, "no_inst": 4}
    assert (tile.instructions, tile.samples) == (4, 12 + 7 + 8 + 5)
    assert nr.by_count(rows())[0].executed == 40  # the most sampled first
    assert sum(g.samples for g in regions.values()) == sum(sum(r) for _, r in CODE)


def test_runs_keep_a_stretch_across_short_gaps_and_count_all_of_it():
    start, end = nr.runs(rows(), 40)
    assert (start.first, start.last, start.instructions, start.samples) == (
        "0x7f000020", "0x7f000030", 2, 19)
    # The tile's end: its two instructions and the two masked reductions between them.
    assert (end.first, end.last, end.instructions, end.samples) == (
        "0x7f000080", "0x7f0000b0", 4, 8 + 9 + 9 + 5)
    assert end.reasons["lg"] == 18
    (loop,) = nr.runs(rows(), 800)  # the branch target of count 801 does not split it
    assert (loop.instructions, loop.samples) == (4, 18)
    # A gap longer than allowed splits the stretch.
    assert len(nr.runs(rows(), 40, gap=1)) == 3


def test_main_json_and_errors(tmp_path, capsys):
    path = tmp_path / "sass.csv"
    path.write_text(page())
    assert nr.main([str(path), "--json", "--runs", "40"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["samples"] == sum(sum(r) for _, r in CODE)
    assert [g["instructions"] for g in out["regions"]] == [2, 4]
    assert nr.main([str(path)]) == 0
    assert "warp samples" in capsys.readouterr().out
    with pytest.raises(ValueError, match="Address"):
        nr.read_rows(io.StringIO('"Kernel Name","_k",\n"a","b"\n'))
    bad = page().replace("Instructions Executed", "Executed")
    with pytest.raises(ValueError, match="set full"):
        nr.read_rows(io.StringIO(bad))
