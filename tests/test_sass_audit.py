"""The sm_90 SASS audit of the tensor-core kernels (`tools/sass_audit.py`), on the CPU.

Compiling needs the real (not interpreted) kernels, so the whole audit runs in a
subprocess without TRITON_INTERPRET; the walk over SASS is checked in-process on
hand-written instruction sequences.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")
sys.path.insert(0, TOOLS)
from sass_audit import (  # noqa: E402
    programs_an_sm,
    register_a_hazards,
    schedule,
    static_cycles,
    wgmma_loops,
)


def _compiled(*args: str, timeout: int = 600) -> str:
    """stdout of `python *args` with the kernels compiled, not interpreted (no
    TRITON_INTERPRET); fails the test with the end of stderr if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [TOOLS, env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def _sass(*lines: str) -> str:
    """cuobjdump-style text: one instruction a line at addresses 0x0000, 0x0010, ..."""
    return "\n".join(f"        /*{16 * n:04x}*/                   {ins} ;"
                     for n, ins in enumerate(lines))


def test_walk_flags_a_write_under_a_pending_wgmma_across_the_back_edge():
    body = (
        "LDSM.16.M88.4 R152, [R2+UR7+0xc000]",          # 0x00 loop top: A registers
        "WARPGROUP.ARRIVE",
        "HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR28], R88, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",                 # retired: the next write is safe
        "HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR32], R88, gsb0",  # left pending
        "@!P0 BRA 0x0",                                  # back to the LDSM
    )
    n_reg_a, hazards = register_a_hazards(_sass(*body))
    assert n_reg_a == 2
    assert [h["addr"] for h in hazards] == ["0x0"]
    assert hazards[0]["registers"] == [152, 153, 154, 155]
    assert "second lap" in hazards[0]["where"]


def test_walk_accepts_waits_that_retire_the_group_first():
    body = (
        "LDSM.16.M88.4 R152, [R2+UR7+0xc000]",
        "HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR28], R88, gsb0",
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], gdesc[UR12], R24, gsb0",
        # one group may stay pending: the newest, whose A is in shared memory
        "WARPGROUP.DEPBAR.LE gsb0, 0x1",
        "IMAD.MOV.U32 R153, RZ, RZ, R7",
        "@!P0 BRA 0x0",
    )
    n_reg_a, hazards = register_a_hazards(_sass(*body))
    assert n_reg_a == 1 and hazards == []
    # the same write before the wait is a hazard, in straight-line code too
    early = list(body)
    early.insert(3, "IMAD.MOV.U32 R155, RZ, RZ, R7")
    assert [(h["addr"], h["registers"]) for h in register_a_hazards(_sass(*early))[1]] == \
        [("0x30", [155])]


def _scheduled(*rows: tuple) -> str:
    """cuobjdump -sass text with encodings: (instruction, stall, write_sb, read_sb, wait)
    per row, the schedule in bits 41-62 of the second word (yield set)."""
    out = []
    for n, (ins, stall, wsb, rsb, wait) in enumerate(rows):
        hi = (stall | 1 << 4 | wsb << 5 | rsb << 8 | wait << 11) << 41
        out.append(f"        /*{16 * n:04x}*/                   {ins} ;"
                   f"                   /* 0x000000ff00007820 */\n"
                   f"                                          /* 0x{hi:016x} */")
    return "\n".join(out)


def test_schedule_reads_the_control_bits_of_real_sass():
    # Two instructions as cuobjdump printed them for the fp8 Gluon kernel (sm_90a): an
    # FMNMX with 2 stall cycles and no scoreboard; one that waits for scoreboard 1.
    text = ("        /*1220*/                   FMNMX R3, |R44|, R3, !PT ;"
            "                                           /* 0x000000032c037209 */\n"
            "                                                                  "
            "                                      /* 0x000fc40007800200 */\n"
            "        /*1260*/                   FMNMX R30, R67, R30, !PT ;"
            "                                           /* 0x0000001e431e7209 */\n"
            "                                                                  "
            "                                      /* 0x002fe20007800000 */")
    rows = schedule(text)
    assert [(r["addr"], r["stall"], r["yield"], r["write_sb"], r["read_sb"], r["wait"])
            for r in rows] == [(0x1220, 2, 0, 7, 7, 0), (0x1260, 1, 1, 7, 7, 0b10)]


def test_static_cycles_waits_for_scoreboards_and_counts_stalls():
    body = schedule(_scheduled(
        ("MUFU.EX2 R4, R2", 1, 0, 7, 0),         # t=0, result on scoreboard 0 at 18
        ("FMUL R5, R3, R3", 4, 7, 7, 0),         # t=1
        ("FMUL R6, R4, R5", 2, 7, 7, 0b1),       # waits for the MUFU: t=18
        ("STS [R0], R6", 1, 7, 2, 0),            # t=20, sources read at 28
        ("IADD3 R0, R0, 0x4, RZ", 3, 7, 7, 0b100),  # waits for the store's read: t=28
    ))
    assert static_cycles(body) == 28 + 3
    assert static_cycles(body, read_latency=1) == 21 + 3


def test_wgmma_loops_are_the_innermost_loops_holding_one():
    text = _scheduled(
        ("IADD3 R1, R1, 0x1, RZ", 1, 7, 7, 0),                         # 0x00 outer loop top
        ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0", 1, 7, 7, 0),  # 0x10 inner top
        ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 1, 7, 7, 0),
        ("@P0 BRA 0x10", 5, 7, 7, 0),                                   # 0x30: inner loop
        ("ISETP.GE.AND P1, PT, R1, 0x8, PT", 1, 7, 7, 0),
        ("@!P1 BRA 0x0", 5, 7, 7, 0),                                   # 0x50: outer loop
        ("FADD R2, R2, R3", 1, 7, 7, 0),                                # 0x60: no wgmma
        ("@P2 BRA 0x60", 5, 7, 7, 0),
    )
    assert wgmma_loops(text) == [{"addr": "0x10", "instructions": 3, "wgmmas": 1,
                                  "issue_cycles": 7, "static_cycles": 7,
                                  "tile_start": 1, "tile_end": 2,
                                  # per opcode (predicate and suffixes dropped): count,
                                  # stall cycles summed
                                  "opcodes": {"HGMMA": (1, 1), "WARPGROUP": (1, 1),
                                              "BRA": (1, 5)}}]
    # Without the outer loop's branch no loop encloses it.
    flat = text.replace("@!P1 BRA 0x0", "@!P1 BRA 0x70")
    assert [(lp["tile_start"], lp["tile_end"]) for lp in wgmma_loops(flat)] == [(None, None)]


def test_compiled_sm90_kernels_have_no_register_a_hazards():
    # The tensor-core kernels at the tiles their launchers pick on sm_90 (MAGI-2 dims),
    # compiled here with Triton's own ptxas and cuobjdump; the canary kernel keeps the
    # pattern of the logits kernel's old race and must be flagged.
    rows = json.loads(_compiled(os.path.join(TOOLS, "sass_audit.py"), "--json", timeout=900))
    canary, shipped = rows[0], rows[1:]
    assert canary["kernel"].startswith("canary") and canary["hazards"], canary
    names = [r["kernel"] for r in shipped]
    for prefix in ("logits", "expert forward", "expert forward ws", "expert forward fp8",
                   "expert forward fp8 ws", "expert dx", "expert dW", "panel dW",
                   "panel dx", "expert panels ws", "router dx", "router d gate", "row keys"):
        assert any(n.startswith(prefix) for n in names), (prefix, names)
    # The Gluon dW GEMM compiles though no table row runs it (the issue-26 ruling).
    assert any(n.startswith("panel dW") and "(Gluon)" in n for n in names), names
    assert [r for r in shipped if r["hazards"]] == []
    # not vacuous: the expert forward and dx kernels (bf16 HGMMAs, the Triton fp8 kernel's
    # QGMMAs) and the router backward's do feed wgmmas from registers (the fp8 Gluon
    # kernel stages both operands in shared memory: none of its wgmmas can have the hazard;
    # the dx kernel without dx has no product with a register operand left)
    # The dx kernel's 32-row tiles run mma.sync (a wgmma takes 64 rows a warpgroup), to
    # which the hazard does not apply.
    assert all(r["hgmma_register_a"] > 0 for r in shipped
               if r["kernel"].startswith(("expert forward", "expert dx", "router"))
               and not r["kernel"].startswith(("expert forward fp8 ws", "expert dx 32/"))
               and not r["kernel"].endswith("no dx"))
    assert all(not r["wgmmas"] for r in shipped if r["kernel"].startswith("expert dx 32/"))
    # The Gluon kernel keeps wgmma groups in flight where it asks to (ptxas serialises
    # every wgmma, silently but for an info line, when its registers run short).
    # Both modes, one CTA and the cluster variant.
    ws = [r for r in shipped if r["kernel"].startswith("expert forward ws")]
    assert len(ws) == 6 and all(r["async_waits"] >= 14 for r in ws), ws  # + sigmoid_rcp x 2
    # The default mode's fp32 adds are reductions (REDG: nothing comes back) in both
    # variants. gl.atomic_add's version compiled to REDG in the one-CTA kernel but to
    # ATOMG, which returns the old values, in the cluster variant: each warp then waited
    # on the round trips. The deterministic mode stores; neither mode counts.
    for r in ws:
        default = "deterministic" not in r["kernel"]
        assert r["reductions"] == (128 if default else 0) and r["fp32_atomics"] == 0, r
        assert r["counts"] == 0, r
    # The fp8 Gluon kernel: every product on the fp8 tensor cores, at the planned shapes
    # (per MMA warpgroup: gate|up as N = 128 over two K = 128 chunks in block 0 and in the
    # loop's block; the down product as one N = 256 over K = 64 in the loop's and in the
    # last block), the same waits in flight in both modes, and the combine as the bf16
    # kernel's.
    fp8_ws = [r for r in shipped if r["kernel"].startswith("expert forward fp8 ws")]
    # both modes, and the default one with reciprocals and with skip_empty_halves (whose
    # warpgroup 1 has a path without wgmmas: the same wgmmas and waits), and as the table
    # runs it: the reciprocals with chunked_x in both modes, with skip_empty_halves
    assert len(fp8_ws) == 7, fp8_ws
    # The skip is there: its path adds mbarrier arrivals (x hand-off, ring, turn) and no
    # wgmma (the shapes below are the default's).
    by_name = {r["kernel"]: r for r in fp8_ws}
    assert by_name["expert forward fp8 ws (Gluon) skip empty halves"]["mbarrier_arrives"] > \
        by_name["expert forward fp8 ws (Gluon)"]["mbarrier_arrives"], by_name
    # chunked_x: a tile's start (x's quantization and block 0) shrinks by the unrolled
    # quantization, to less than two thirds of the default's, in each warpgroup's code.
    rcp = by_name["expert forward fp8 ws (Gluon) reciprocals"]
    for name in ("reciprocals chunked x", "deterministic reciprocals chunked x"):
        chunked = by_name[f"expert forward fp8 ws (Gluon) {name}"]
        for a, b in zip(chunked["loops"], rcp["loops"], strict=True):
            assert a["tile_start"] < 2 * b["tile_start"] / 3, (a, b)
    for r in fp8_ws:
        assert r["wgmmas"] == {"QGMMA.64x128x32": 32, "QGMMA.64x256x32": 8}, r
        assert r["async_waits"] >= 6, r
        default = "deterministic" not in r["kernel"]
        assert r["reductions"] == (128 if default else 0) and r["fp32_atomics"] == 0, r
    # The backward's Gluon panel kernel: per MMA warpgroup and slice, gate|up as N = 128
    # over four K = 64 chunks and t as N = 64 over four, both from shared memory; one
    # wgmma kept in flight while the next is issued (7 waits a block: each stage goes back
    # to the loader as soon as its wgmmas retired); no combine (dx comes from the panels).
    # Both variants: the default, and the sigmoid's reciprocal with 8-byte stores.
    panels = {r["kernel"]: r for r in shipped if r["kernel"].startswith("expert panels ws")}
    assert len(panels) == 2, panels
    for r in panels.values():
        assert r["wgmmas"] == {"HGMMA.64x128x16": 32, "HGMMA.64x64x16": 32}, r
        assert r["async_waits"] >= 14 and r["hgmma_register_a"] == 0, r
        assert r["reductions"] == 0 and r["fp32_atomics"] == 0, r
    # Its dg, du and a p panels leave in 16-byte stores (per MMA warpgroup's code, a slice:
    # 3 panels x 2 row halves x 2 column halves, 12; both warpgroups' code is counted),
    # or in the variant in 8-byte ones (3 panels x 2 row halves x 4 pairs of groups, 24);
    # only the dprobs rows are 4-byte stores.
    assert panels["expert panels ws (Gluon)"]["stores"] == {"16": 24, "4": 4}, panels
    assert panels["expert panels ws (Gluon) rcp, 8-byte stores"]["stores"] == \
        {"8": 48, "4": 4}, panels
    # ExpertBackwardConfig.sigmoid_rcp: the sigmoid's reciprocal without the full-range
    # division's range checks (which the defaults show: the count is not vacuous).
    for r in shipped:
        if r["kernel"].startswith(("expert panels ws", "expert dx 128/16/8/3 panels")):
            rcp = "rcp" in r["kernel"]
            assert r["rcp"] > 0 and (r["division_range_checks"] == 0) == rcp, r
    # Fp8ForwardConfig.reciprocals: no division with its range checks left (the defaults
    # have 50 and 172, as compiled).
    fp8 = {r["kernel"]: r for r in shipped if r["kernel"].startswith("expert forward fp8")}
    for name in ("expert forward fp8 64/64/4/3", "expert forward fp8 ws (Gluon)"):
        default, rcp = fp8[name], fp8[f"{name} reciprocals"]
        assert rcp["division_range_checks"] == 0 < default["division_range_checks"], fp8
    # ExpertForwardConfig.sigmoid_rcp: the bf16 forward kernels' sigmoid without them.
    bf16 = {r["kernel"]: r for r in shipped if r["kernel"].startswith("expert forward")
            and "fp8" not in r["kernel"] and "deterministic" not in r["kernel"]}
    for name in ("expert forward ws (Gluon)", "expert forward ws (Gluon) cluster 2",
                 "expert forward 64/32/4/4"):
        assert bf16[name]["division_range_checks"] > 0, bf16
        assert bf16[f"{name} sigmoid_rcp"]["division_range_checks"] == 0, bf16
    # The MMA warpgroups' loops over slices of I, scheduled by ptxas (`wgmma_loops`,
    # compile-only): both variants of the panel kernel and of the fp8 Gluon forward have
    # two (one an MMA warpgroup) with the block's wgmmas, and the variants' loops issue in
    # fewer cycles than the defaults' (docs/expert-backward.md, docs/fp8.md).
    for default, variant, wgmmas in (
            ("expert panels ws (Gluon)", "expert panels ws (Gluon) rcp, 8-byte stores", 32),
            ("expert forward fp8 ws (Gluon)", "expert forward fp8 ws (Gluon) reciprocals", 10)):
        loops = {name: {**panels, **fp8}[name]["loops"] for name in (default, variant)}
        assert all(len(v) == 2 and all(lp["wgmmas"] == wgmmas for lp in v)
                   for v in loops.values()), loops
        assert max(lp["issue_cycles"] for lp in loops[variant]) < \
            min(lp["issue_cycles"] for lp in loops[default]), loops
    # dx from the panels: one N = 256 product a step of 64, in two loops (gate, then up),
    # each keeping a wgmma in flight across its steps; both modes.
    for r in (r for r in shipped if r["kernel"].startswith("panel dx")):
        assert r["wgmmas"] == {"HGMMA.64x256x16": 8} and r["async_waits"] == 2, r
    # What a program holds: every kernel fits an SM; the Gluon panel kernels run one
    # program of 12 warps (a loader warpgroup and two MMA ones) an SM, at their launch's
    # register cap.
    for r in shipped:
        rs = r["resources"]
        assert 0 < rs["registers"] <= 255 and rs["programs"] >= 1, r
        assert rs["shared"] <= 232448, r
    for r in panels.values():
        rs = r["resources"]
        assert (rs["threads"], rs["registers"], rs["programs"]) == (384, 168, 1), rs


def test_programs_an_sm_by_hand():
    # 90 registers round up to 96 a thread, 3,072 a warp: a sub-partition's 16,384 hold 5
    # warps, the SM 20, five programs of 4 warps; 49,168 bytes of shared memory plus the
    # 1 KB reserved, in 128-byte units 50,304, go 4 times into 233,472; 128 threads 16
    # times into 2,048.
    assert programs_an_sm(90, 128, 49168) == {"programs": 4, "by_registers": 5,
                                              "by_shared": 4, "by_threads": 16}
    # 168 registers over 384 threads: 5,376 a warp, 3 warps a sub-partition, one program
    # of 12 warps; 232,448 bytes of shared memory is the most one program may take.
    assert programs_an_sm(168, 384, 232448)["programs"] == 1
    # 32 registers, 32 threads, no shared memory: the 32-program limit binds.
    assert programs_an_sm(32, 32, 0) == {"programs": 32, "by_registers": 64,
                                         "by_shared": 228, "by_threads": 64}
    # Where the sub-partitions bind: 48 registers a thread, 1,536 a warp, 10 warps a
    # sub-partition, 40 an SM: 20 programs of 2 warps (the whole file would give 42 warps).
    assert programs_an_sm(48, 64, 0)["by_registers"] == 20
    # Shared memory in 128-byte units: 45,568 + 1,024 bytes (364 units) fit 5 times; one
    # byte more takes 365 units, 46,720 bytes, which fit 4 times (unrounded, 5 would).
    assert programs_an_sm(32, 128, 45568)["by_shared"] == 5
    assert programs_an_sm(32, 128, 45569)["by_shared"] == 4


def test_panel_tiles_table_of_the_dw_gemm():
    # docs/expert-backward.md, "The dW GEMMs at few rows an expert": the table's tile, the
    # one-stage ones and the one that spills, compile-only.
    rows = json.loads(_compiled(os.path.join(TOOLS, "sass_audit.py"), "--json",
                                "--panel-tiles",
                                "64/128/64/4/2;64/128/64/4/1;64/64/64/4/1;64/128/64/2/1",
                                timeout=300))
    got = {r["kernel"]: r["resources"] for r in rows[1:]}
    assert len(got) == 8, list(got)
    want = {"64/128/64/4/2": (90, 49168, 4), "64/128/64/4/1": (90, 24584, 5),
            "64/64/64/4/1": (58, 16392, 8)}
    for shape in ("256x1280", "1280x256"):
        for tile, (regs, shared, programs) in want.items():
            rs = got[f"panel dW {shape} {tile} (dx rows 64)"]
            assert (rs["registers"], rs["spill_stores"], rs["spill_loads"], rs["shared"],
                    rs["programs"]) == (regs, 0, 0, shared, programs), (shape, tile, rs)
        # two warps cannot hold a 64 x 128 fp32 accumulator with the rest: ptxas spills
        rs = got[f"panel dW {shape} 64/128/64/2/1 (dx rows 64)"]
        assert rs["registers"] == 255 and rs["spill_stores"] > 0, rs


_CLUSTER_PROBE = """
import json, re
import sass_audit
from mhmoe.kernels import expert_forward_sm90 as ws
from mhmoe.kernels.tuning import expert_forward_sm90_config
cfg = expert_forward_sm90_config()
sig, cx = ws.sm90_signature(cfg, 256, 1280, False, 2)
k = sass_audit.compile_sm90(ws._expert_forward_sm90_kernel, sig, cx, cfg.num_warps, 1,
                            ("stride_xs", "stride_xh"), cfg.maxnreg)
ptx = k.asm["ptx"]
consts = {int(c) for c in re.findall(r"@global_smem, i32 (\\d+)", k.asm["llir"])}
print(json.dumps({"offsets": ws.smem_offsets(k.asm["llir"]), "shared": k.metadata.shared,
                  "x_halves_found": [o in consts for o in (163840, 196608)],
                  "tensormap_fences": ptx.count("fence.proxy.tensormap::generic.acquire"),
                  "stages_bytes": cfg.num_stages * 64 * 128 * 2,
                  "multicast": ptx.count(".multicast::cluster"),
                  "remote_arrive": ptx.count("mbarrier.arrive.shared::cluster"),
                  "cluster_barriers": ptx.count("barrier.cluster.wait")}))
"""


def test_cluster_variant_compiles_with_its_inline_ptx():
    # The cluster variant of the Gluon kernel addresses its ring and barriers
    # by shared-memory offsets: the ring at 0 (so the x tile's halves right after its
    # NSTAGE * 16 KB), the barriers read from the compiled LLVM IR (`smem_offsets`), which
    # must find them past the ring and apart; and its inline PTX must be in the kernel:
    # the multicast copies (4 forms in each of the 6 stage loads of a slice), the
    # cross-CTA arrivals, a tensor-map fence a weight and a cluster barrier at both ends
    # of every partition.
    got = json.loads(_compiled("-c", _CLUSTER_PROBE).strip().splitlines()[-1])
    ready, peer_free = got["offsets"]
    assert got["stages_bytes"] <= ready < got["shared"], got
    assert got["stages_bytes"] <= peer_free < got["shared"] and peer_free != ready, got
    assert got["stages_bytes"] == 163840 and got["x_halves_found"] == [True, True], got
    assert got["multicast"] == 24 and got["remote_arrive"] == 6, got
    assert got["tensormap_fences"] == 3, got
    assert got["cluster_barriers"] == 10, got
