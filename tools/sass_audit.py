"""Audit of the compiled sm_90 code of the tensor-core kernels; no GPU needed.

    python tools/sass_audit.py          # a table
    python tools/sass_audit.py --json   # rows for scripts and tests
    python tools/sass_audit.py --opcodes panels   # the kernels whose name holds "panels",
                                        # with each wgmma loop's opcodes (count, issue cycles)
    python tools/sass_audit.py --resources panels   # registers, spills, shared memory,
                                        # programs an SM
    python tools/sass_audit.py --panel-tiles "64/128/64/4/1;64/64/64/4/1"   # the panel
                                        # dW GEMM at other tiles: the same table

(without TRITON_INTERPRET: the interpreter's kernels cannot be compiled).

What it checks. A wgmma (an HGMMA instruction in SASS; QGMMA for fp8) may take its A operand
from registers. PTX leaves it undefined to write those registers before a
`wgmma.wait_group` has retired that wgmma. Triton 3.6 emitted exactly that in
the router logits kernel: its pipelined loop loaded the next x tile into the
registers of a wgmma still in flight. Calls then gave wrong logits now and
then (docs/routing.md, "The race in the logits kernel, and the SASS audit").
Neither Triton nor ptxas reported anything.

How. Each kernel of `mhmoe.kernels.sm90_compile_cases()` is compiled with Triton
for sm_90 at the tiles its launcher picks on an H100/H200 at MAGI-2's dims (so a
GPU-only kernel that stops compiling fails here, and `make test` runs this). The
PTX is assembled with the ptxas of the Triton wheel and disassembled with its
cuobjdump. Then the SASS is walked
(`register_a_hazards`):
- HGMMAs join a commit group until the one marked `gsb0` closes it.
- `WARPGROUP.DEPBAR.LE gsb0, N` retires all but the newest N groups.
- Any instruction whose destination register holds the A operand of a group
  not yet retired is a hazard.
- A loop (a conditional branch backwards over an HGMMA) is walked twice, the
  second time with the groups still pending at its end. A hazard across the
  back-edge shows there.

The destination is read as the first register operand of the instruction
(vector loads and 64-bit ops cover 2-4 registers). Stores, branches, barriers,
uniform-datapath and predicate-only instructions write no general register and
are skipped. This is a heuristic reading of SASS, not a proof. It found the
race above, and a kernel built to have the same pattern (`_canary_kernel`) is
audited with the others: a checker that stopped seeing hazards would fail on
it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl


def toolchain() -> tuple[str, str]:
    """Paths of the ptxas and cuobjdump shipped with Triton."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    tools = tuple(os.path.join(bin_dir, name) for name in ("ptxas", "cuobjdump"))
    missing = [t for t in tools if not os.path.exists(t)]
    if missing:
        raise RuntimeError(f"sass_audit: not found in the Triton wheel: {', '.join(missing)}")
    return tools


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int,
                 divisible: tuple[str, ...] = (), maxnreg: int | None = None,
                 num_ctas: int = 1):
    """Triton or Gluon kernel `fn` compiled here for sm_90 (no GPU needed): the compiled
    kernel, whose .asm["ptx"] and .metadata.shared the callers read.

    signature: argument name -> Triton type ("*bf16", "i32", "tensordesc<bf16[64, 32]>");
    pointers and the `divisible` integers are marked 16-divisible, as the JIT marks the
    launchers' aligned pointers and strides. maxnreg: the launch's register limit;
    num_ctas: CTAs a cluster."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    from triton.runtime.jit import JITFunction

    if not isinstance(fn, JITFunction):
        raise RuntimeError("sass_audit: kernels are interpreted here (TRITON_INTERPRET=1); "
                           "compile without it")
    # Arguments left out take their defaults, as at a launch (ASTSource alone would not).
    constexprs = {**{p.name: p.default for p in fn.params
                     if p.has_default and p.name not in signature}, **constexprs}
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]]
             for k, t in sig.items() if t.startswith("*") or k in divisible}
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else triton.compiler.ASTSource
    options = {"num_warps": num_warps, "num_stages": num_stages, "num_ctas": num_ctas}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(source(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def compile_sass(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int,
                 divisible: tuple[str, ...] = (), maxnreg: int | None = None) -> str:
    """SASS (sm_90a) of kernel `fn`; arguments as `compile_sm90` (for scripts that read
    one kernel's SASS; the audit itself takes `assemble`'s resources too)."""
    return assemble(compile_sm90(fn, signature, constexprs, num_warps, num_stages, divisible,
                                 maxnreg))[0]


# An sm_90 SM: registers (in four sub-partitions, each warp's taken from one, in blocks of
# 256), shared memory (each program reserves 1 KB and takes it in 128-byte units), threads
# and programs it can hold: the rules of CUDA's occupancy calculator (cuda_occupancy.h).
_SM90_LIMITS = dict(registers=65536, sub_partitions=4, shared=233472, reserved=1024,
                    shared_unit=128, threads=2048, programs=32)
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def programs_an_sm(registers: int, threads: int, shared: int) -> dict:
    """How many programs of a kernel an sm_90 SM holds at once, and which limit binds:
    {"programs", "by_registers", "by_shared", "by_threads"}."""
    lim = _SM90_LIMITS
    per_warp = -(-registers * 32 // 256) * 256
    warps = (lim["registers"] // lim["sub_partitions"] // per_warp) * lim["sub_partitions"]
    unit = lim["shared_unit"]
    by = {"by_registers": warps // -(-threads // 32),
          "by_shared": lim["shared"] // (-(-(shared + lim["reserved"]) // unit) * unit),
          "by_threads": lim["threads"] // threads}
    return {"programs": min(lim["programs"], *by.values()), **by}


def assemble(kernel) -> tuple[str, dict]:
    """The SASS (sm_90a) of a kernel from `compile_sm90`, and what a program of it holds:
    registers a thread and spill bytes (`ptxas -v`), shared memory (Triton's), threads
    (every partition's warps) and `programs_an_sm`."""
    ptxas, cuobjdump = toolchain()
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", cubin], check=True,
                                capture_output=True, text=True).stderr
        sass = subprocess.run([cuobjdump, "-sass", cubin], check=True, capture_output=True,
                              text=True).stdout
    spills = [tuple(map(int, m)) for m in _PTXAS_SPILLS.findall(report)]
    used = [int(n) for n in _PTXAS_REGISTERS.findall(report)]
    if not used:
        raise RuntimeError(f"sass_audit: no register count in ptxas -v's report:\n{report}")
    resources = {"registers": max(used),
                 "spill_stores": sum(st for st, _ in spills),
                 "spill_loads": sum(ld for _, ld in spills),
                 "shared": kernel.metadata.shared,
                 "threads": kernel.metadata.num_warps * 32}
    resources.update(programs_an_sm(resources["registers"], resources["threads"],
                                    resources["shared"]))
    return sass, resources


_INSTR = re.compile(r"/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
# HGMMA: 16-bit operands; QGMMA: fp8. Either takes 4 registers of A a thread.
_HGMMA_REG_A = re.compile(r"(?:@\S+\s+)?[HQ]GMMA\.\S+\s+R\d+,\s+R(\d+),")
_ASYNC_WAIT = re.compile(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x[1-9a-f]")
# Global atomics: fp32 pair adds with nothing returned, fp32 adds returning the old values,
# and integer adds returning the old values (counters).
_COMBINE_OPS = {"reductions": re.compile(r"REDG\.E\.ADD\.F32x2"),
                "fp32_atomics": re.compile(r"ATOMG\.E\.ADD\.F32"),
                "counts": re.compile(r"ATOMG\.E\.ADD\.STRONG")}


_WGMMA = re.compile(r"\b([HQ]GMMA\.\d+x\d+x\d+)")


def wgmma_shapes(sass: str) -> dict:
    """wgmma instructions by kind and shape ("HGMMA.64x128x16": 16-bit operands,
    "QGMMA.64x256x32": fp8) -> how many the SASS has."""
    counts: dict = {}
    for name in _WGMMA.findall(sass):
        counts[name] = counts.get(name, 0) + 1
    return counts


def async_waits(sass: str) -> int:
    """How many waits leave wgmma groups in flight (`WARPGROUP.DEPBAR.LE gsb0, N > 0`)."""
    return len(_ASYNC_WAIT.findall(sass))


def combine_ops(sass: str) -> dict:
    """How many of each kind of global atomic add (`_COMBINE_OPS`) the SASS has."""
    return {name: len(pattern.findall(sass)) for name, pattern in _COMBINE_OPS.items()}
_BACK_BRANCH = re.compile(r"@!?U?P\w+\s+BRA\s+(0x[0-9a-f]+)")
# Opcodes that write no general register (or whose first operand is not a destination).
_NO_DEST = ("ST", "RED", "BAR", "BRA", "SYNCS", "UTMA", "WARPGROUP", "EXIT", "ISETP",
            "FSETP", "DSETP", "HSETP", "PLOP3", "NOP", "CCTL", "MEMBAR", "FENCE", "ELECT",
            "DEPBAR", "LDGDEPBAR", "VOTEU", "ERRBAR", "CALL", "RET", "YIELD", "ACQ", "WARPSYNC",
            "BSYNC", "BSSY", "R2UR")


_GLOBAL_STORE = re.compile(r"\bSTG\.E((?:\.\w+)*)")
_STORE_WIDTH = {".128": 16, ".64": 8, ".U16": 2, ".S16": 2, ".U8": 1, ".S8": 1}


def global_stores(sass: str) -> dict:
    """Register-to-global stores (STG) by width in bytes -> how many the SASS has: 4 with
    no width modifier, else 16 (.128), 8 (.64), 2 (.U16) or 1 (.U8). TMA stores are not
    STG."""
    counts: dict = {}
    for modifiers in _GLOBAL_STORE.findall(sass):
        widths = [_STORE_WIDTH[m] for m in re.findall(r"\.\w+", modifiers)
                  if m in _STORE_WIDTH]
        width = widths[0] if widths else 4
        counts[width] = counts.get(width, 0) + 1
    return counts


# The full-range fp32 division (div.full.f32) compares its divisor with 2^126 before the
# reciprocal, to rescale it; rcp.approx.ftz is the reciprocal alone.
_DIVISION_RANGE_CHECK = re.compile(r"\bFSETP\.[\w.]+\s+P\d+,\s*PT,\s*\|?R\d+\|?(?:\.reuse)?,"
                                   r"\s*8\.50705917302346158658e\+37")


def reciprocals(sass: str) -> dict:
    """{"rcp": MUFU.RCP instructions, "division_range_checks": the full-range division's
    comparisons with 2^126} in the SASS."""
    return {"rcp": len(re.findall(r"\bMUFU\.RCP\b", sass)),
            "division_range_checks": len(_DIVISION_RANGE_CHECK.findall(sass))}


# Scheduling. Each 128-bit sm_70+ instruction carries its schedule in bits 105-125, the
# top of the second 64-bit word that cuobjdump prints on the line below it: stall cycles
# before the next instruction of the warp may issue (4 bits), a yield flag, the
# scoreboard the instruction releases when its result is written (3 bits, 7: none), the
# one it releases when its sources have been read (3 bits), the scoreboards it waits for
# (6-bit mask) and operand-reuse flags. The layout is the one micro-benchmark studies
# published for Volta to Ampere; sm_90 SASS reads consistently with it (only
# variable-latency instructions, MUFU, SHFL, loads, SYNCS, conversions, set scoreboards).
_WITH_SCHEDULE = re.compile(r"/\*([0-9a-f]+)\*/\s+(.*?)\s*;\s*/\* 0x[0-9a-f]{16} \*/\s*\n"
                            r"\s*/\* 0x([0-9a-f]{16}) \*/")
# Latencies assumed for the variable-latency instructions (cycles, first-order figures for
# an SM under no contention: hits in L1 or shared memory); a SYNCS wait counts as if the
# barrier were already complete, a wgmma wait as if the wgmma had retired.
_ASSUMED_LATENCY = {"MUFU": 18, "SHFL": 28, "LDS": 30, "LDSM": 30, "LDL": 40, "LDG": 600,
                    "LDC": 20, "S2R": 20, "S2UR": 20, "SYNCS": 40, "F2F": 12, "F2I": 12,
                    "I2F": 12}


def schedule(sass: str) -> list[dict]:
    """Per instruction of SASS text printed with its encoding (cuobjdump -sass): addr, ins,
    stall, yield, write_sb, read_sb (7: none) and wait (scoreboard mask)."""
    rows = []
    for m in _WITH_SCHEDULE.finditer(sass):
        ctl = int(m.group(3), 16) >> 41
        rows.append({"addr": int(m.group(1), 16), "ins": m.group(2), "stall": ctl & 0xF,
                     "yield": ctl >> 4 & 1, "write_sb": ctl >> 5 & 7, "read_sb": ctl >> 8 & 7,
                     "wait": ctl >> 11 & 0x3F})
    return rows


def static_cycles(body: list[dict], read_latency: int = 8) -> int:
    """Cycles one warp takes to issue `body` (rows of `schedule`) straight through, alone
    on its SM sub-partition: each instruction issues its predecessor's stall count after
    it, and not before the scoreboards it waits for are released (results after
    `_ASSUMED_LATENCY`, 20 cycles for others; sources after read_latency)."""
    t = 0
    released = [0] * 6
    for n, row in enumerate(body):
        if n:
            t += max(body[n - 1]["stall"], 1)
        t = max([t] + [released[b] for b in range(6) if row["wait"] >> b & 1])
        op = _opcode_and_operands(row["ins"])[0].split(".")[0]
        if row["write_sb"] != 7:
            released[row["write_sb"]] = t + _ASSUMED_LATENCY.get(op, 20)
        if row["read_sb"] != 7:
            released[row["read_sb"]] = max(released[row["read_sb"]], t + read_latency)
    return t + max(body[-1]["stall"], 1) if body else 0


def _backward_loops(prog: list[tuple[int, str]]):
    """(top, end, body) of each loop that a conditional branch backwards closes, for
    (address, instruction) pairs in address order: body is the pairs from the branch's
    target (top) to the branch itself (end)."""
    for end, ins in prog:
        m = _BACK_BRANCH.match(ins)
        if m and int(m.group(1), 16) < end:
            top = int(m.group(1), 16)
            yield top, end, [(a, i) for a, i in prog if top <= a <= end]


def wgmma_loops(sass: str) -> list[dict]:
    """The innermost loops (branches backwards) holding a wgmma, in address order: in the
    persistent Gluon kernels, each MMA warpgroup's loop over slices of I. Per loop: addr,
    instructions, wgmmas, issue_cycles (its stall counts summed) and static_cycles
    (`static_cycles`). A compile-only reading of how long one warp needs to get through a
    slice when nothing makes it wait (other warps, the tensor cores, barriers); not a
    measurement. tile_start, tile_end: the instructions of the smallest loop around it (in
    those kernels the loop over tiles) before its top and after its branch, the code a
    tile runs once around its slices (None where no loop encloses it)."""
    rows = schedule(sass)
    by_addr = {r["addr"]: r for r in rows}
    closed = list(_backward_loops([(r["addr"], r["ins"]) for r in rows]))
    loops = []
    for top, end, body in closed:
        n = sum(1 for _, ins in body if _WGMMA.search(ins))
        if n:
            loops.append((top, end, [by_addr[a] for a, _ in body], n))
    inner = [lp for lp in loops if not any(lp[0] <= o[0] and o[1] <= lp[1] and o != lp
                                           for o in loops)]
    out = []
    for top, end, body, n in sorted(inner):
        around = [lp for lp in closed if lp[0] <= top and end <= lp[1] and lp[1] - lp[0] >
                  end - top]
        opcodes = {}
        for r in body:
            op = _opcode_and_operands(r["ins"])[0].split(".")[0]
            count, cycles = opcodes.get(op, (0, 0))
            opcodes[op] = (count + 1, cycles + max(r["stall"], 1))
        row = {"addr": hex(top), "instructions": len(body), "wgmmas": n,
               "issue_cycles": sum(cycles for _, cycles in opcodes.values()),
               "static_cycles": static_cycles(body), "tile_start": None, "tile_end": None,
               "opcodes": opcodes}
        if around:
            o_body = min(around, key=lambda lp: lp[1] - lp[0])[2]
            row["tile_start"] = sum(1 for a, _ in o_body if a < top)
            row["tile_end"] = sum(1 for a, _ in o_body if a > end)
        out.append(row)
    return out


def _parse(sass: str) -> list[tuple[int, str]]:
    return [(int(m.group(1), 16), m.group(2)) for m in _INSTR.finditer(sass)]


def _opcode_and_operands(ins: str) -> tuple[str, list[str]]:
    parts = ins.replace(",", " ").split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return (parts[0], parts[1:]) if parts else ("", [])


def _destinations(ins: str) -> set[int]:
    op, operands = _opcode_and_operands(ins)
    if not operands or op.startswith(_NO_DEST) or op.startswith("U"):
        return set()
    m = re.fullmatch(r"R(\d+)(\.\w+)*", operands[0])
    if not m:
        return set()
    width = 1
    if ".64" in op or "WIDE" in op or op.startswith(("DADD", "DMUL", "DFMA")):
        width = 2
    if ".128" in op or (op.startswith("LDSM") and op.endswith(".4")):
        width = 4
    elif op.startswith("LDSM") and op.endswith(".2"):
        width = 2
    first = int(m.group(1))
    return set(range(first, first + width))


def _step(state, addr, ins, hazards, where):
    pending, open_group = state
    op, operands = _opcode_and_operands(ins)
    if op.startswith(("HGMMA", "QGMMA")):
        m = _HGMMA_REG_A.match(ins)
        if m:
            open_group = open_group | set(range(int(m.group(1)), int(m.group(1)) + 4))
        if "gsb0" in ins:
            pending, open_group = [*pending, open_group], set()
        return pending, open_group
    if op.startswith("WARPGROUP.DEPBAR"):
        keep = int(operands[-1], 16)
        return (pending[len(pending) - keep:] if keep else []), open_group
    live = set(open_group).union(*pending)
    clash = live & _destinations(ins)
    if clash:
        hazards.append({"where": where, "addr": hex(addr), "instruction": ins,
                        "registers": sorted(clash)})
    return pending, open_group


def register_a_hazards(sass: str) -> tuple[int, list[dict]]:
    """(HGMMAs with a register A operand, hazards) of SASS text (see the module docstring)."""
    prog = _parse(sass)
    register_a = sum(1 for _, ins in prog if _HGMMA_REG_A.match(ins))
    hazards: list[dict] = []
    state = ([], set())
    for addr, ins in prog:
        state = _step(state, addr, ins, hazards, "straight line")
    for top, addr, body in _backward_loops(prog):
        if not any("GMMA" in i for _, i in body):
            continue
        state = ([], set())
        for lap in range(2):
            for a, i in body:
                state = _step(state, a, i, hazards if lap else [],
                              f"loop {hex(top)}-{hex(addr)}, second lap")
    seen: set[str] = set()  # an instruction found by both walks is reported once
    return register_a, [h for h in hazards if not (h["addr"] in seen or seen.add(h["addr"]))]


@triton.jit
def _canary_kernel(x_desc, w_desc, out_ptr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The pattern of the logits kernel's old race, kept as a self-check of the audit: an x tile
    reshaped out of a 3D box (so Triton keeps it in registers) feeds two dots a step
    of a 3-stage pipelined loop. Never launched."""
    acc = tl.zeros([BLOCK_S, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        xt = x_desc.load([0, 0, d0]).reshape(BLOCK_S, BLOCK_D)
        acc = tl.dot(xt, w_desc.load([0, d0]).T, acc)
        acc = tl.dot(xt, w_desc.load([BLOCK_N, d0]).T, acc)
    rows = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_N)
    tl.store(out_ptr + rows[:, None] * BLOCK_N + cols[None, :], acc)


def _cases(panel_tiles: list | None = None, dx_rows: int = 64):
    """The canary, then `mhmoe.kernels.sm90_compile_cases()`, or with panel_tiles (a list
    of `tuning.PanelGemmConfig`) the panel dW GEMM at those tiles instead, the experts'
    rows padded to dx_rows (the dx kernel's block_m: 32 up to 28 routes an expert, 64 up
    to 64, 128 above)."""
    from mhmoe.kernels import CompileCase, sm90_compile_cases
    from mhmoe.kernels.expert_backward import panel_dw_compile_cases

    canary = CompileCase(
        "canary (must show hazards)", _canary_kernel,
        {"x_desc": "tensordesc<bf16[128, 1, 32]>", "w_desc": "tensordesc<bf16[128, 32]>",
         "out_ptr": "*fp32"},
        dict(D=256, BLOCK_S=128, BLOCK_N=128, BLOCK_D=32), 4, 3)
    if panel_tiles:
        return [canary, *(case for tile in panel_tiles
                          for case in panel_dw_compile_cases(tile, dx_rows))]
    return [canary, *sm90_compile_cases()]


def audit(progress=None, only: str | None = None, panel_tiles: list | None = None,
          dx_rows: int = 64) -> list[dict]:
    """One row per kernel and tile: name, HGMMAs with a register A operand, hazards, and
    the waits that leave wgmma groups in flight (`WARPGROUP.DEPBAR.LE gsb0, N > 0`: none
    where ptxas serialised every wgmma, which it does when registers run short), and its
    global atomic adds (`combine_ops`), its wgmmas by kind and shape (`wgmma_shapes`) and
    its register stores by width (`global_stores`; JSON keys are strings), its
    reciprocals and full-range divisions (`reciprocals`), its innermost loops with a
    wgmma (`wgmma_loops`), its mbarrier arrivals (SYNCS.ARRIVE instructions) and what a
    program holds (`assemble`'s resources).
    only: the kernels whose name holds it (and the canary); panel_tiles, dx_rows: as
    `_cases`."""
    rows = []
    for case in _cases(panel_tiles, dx_rows):
        if only and only not in case.name and not case.name.startswith("canary"):
            continue
        if progress:
            progress(case.name)
        sass, resources = assemble(compile_sm90(
            case.kernel, case.signature, case.constexprs, case.num_warps, case.num_stages,
            case.divisible, case.maxnreg))
        n_reg_a, hazards = register_a_hazards(sass)
        rows.append({"kernel": case.name, "hgmma_register_a": n_reg_a, "hazards": hazards,
                     "async_waits": async_waits(sass), **combine_ops(sass),
                     "wgmmas": wgmma_shapes(sass), "stores": global_stores(sass),
                     **reciprocals(sass), "loops": wgmma_loops(sass),
                     "mbarrier_arrives": len(re.findall(r"\bSYNCS\.ARRIVE", sass)),
                     "resources": resources})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--opcodes", metavar="NAME",
                    help="only the kernels whose name holds NAME, with each wgmma loop's "
                         "opcodes: count and issue cycles (stall counts summed)")
    ap.add_argument("--resources", metavar="NAME", nargs="?", const="",
                    help="a table of what a program holds (registers, spills, shared memory, "
                         "programs an SM) for every kernel, or those whose name holds NAME")
    ap.add_argument("--panel-tiles", metavar="M/N/K/W/S;...",
                    help="audit the panel dW GEMM at these tiles (both MAGI-2 weight shapes) "
                         "instead of the shipped kernels; prints --resources unless "
                         "--opcodes is given")
    ap.add_argument("--dx-rows", type=int, default=64, metavar="N",
                    help="with --panel-tiles: the experts' rows padded to N, the dx "
                         "kernel's block_m (32 up to 28 routes an expert, 64 up to 64, "
                         "128 above; default 64)")
    args = ap.parse_args(argv)
    if args.opcodes is not None and args.resources is not None:
        ap.error("--opcodes and --resources each name the kernels to show: give one")
    panel_tiles = None
    if args.panel_tiles is not None:
        try:
            from mhmoe.kernels.tuning import GLUON_DW_DX_ROWS, PanelGemmConfig
            panel_tiles = [PanelGemmConfig(*map(int, spec.split("/")))
                           for spec in args.panel_tiles.split(";")]
            for cfg in panel_tiles:
                if cfg.warp_specialized and args.dx_rows not in GLUON_DW_DX_ROWS:
                    raise ValueError(f"the Gluon dW GEMM takes dx tiles of {GLUON_DW_DX_ROWS} "
                                     f"rows, got --dx-rows {args.dx_rows}")
                if args.dx_rows % min(cfg.block_k, args.dx_rows):
                    raise ValueError(f"block_k={cfg.block_k} must divide --dx-rows "
                                     f"{args.dx_rows} (or exceed it: then it is clamped "
                                     "to it, as at launch)")
        except (TypeError, ValueError) as exc:
            ap.error(f"--panel-tiles {args.panel_tiles!r}: {exc}")
        if args.resources is None and args.opcodes is None:
            args.resources = ""
    elif args.dx_rows != 64:
        ap.error("--dx-rows goes with --panel-tiles")
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")

    def progress(name):
        print(f"compiling {name} ...", file=sys.stderr, flush=True)

    only = args.opcodes if args.opcodes is not None else args.resources
    rows = audit(progress, only or None, panel_tiles, args.dx_rows)
    if args.json:
        print(json.dumps(rows, indent=1))
    elif args.resources is not None:
        print(f"{'kernel':<58} {'registers':>9} {'spilled':>9} {'shared':>8} {'threads':>7}"
              f"  programs an SM (registers, shared memory, threads)")
        for r in rows[1:]:
            rs = r["resources"]
            print(f"{r['kernel']:<58} {rs['registers']:>9} "
                  f"{rs['spill_stores']:>4}/{rs['spill_loads']:<4} {rs['shared']:>8} "
                  f"{rs['threads']:>7}  {rs['programs']} ({rs['by_registers']}, "
                  f"{rs['by_shared']}, {rs['by_threads']})")
    else:
        for r in rows:
            verdict = f"{len(r['hazards'])} hazards" if r["hazards"] else "clean"
            loops = "; ".join(f"{lp['instructions']} instr, {lp['issue_cycles']} issue /"
                              f" {lp['static_cycles']} static cycles"
                              + (f" (a tile: {lp['tile_start']} before, {lp['tile_end']} after)"
                                 if lp["tile_start"] is not None else "")
                              for lp in r["loops"])
            print(f"{r['kernel']:<58} register-A HGMMAs {r['hgmma_register_a']:>3}  {verdict}"
                  + (f"  loops: {loops}" if loops else ""))
            for h in r["hazards"][:4]:
                print(f"    {h['where']}: {h['addr']} {h['instruction']}")
            for lp in r["loops"] if args.opcodes else ():
                print(f"  loop {lp['addr']}: {lp['instructions']} instructions, "
                      f"{lp['issue_cycles']} issue cycles")
                for op, (count, cycles) in sorted(lp["opcodes"].items(),
                                                  key=lambda kv: -kv[1][1]):
                    print(f"    {op:<10} {count:>5} {cycles:>6}")
    canary_ok = bool(rows[0]["hazards"])
    shipped_ok = not any(r["hazards"] for r in rows[1:])
    if not canary_ok:
        print("the canary kernel shows no hazard: the checker no longer sees the pattern",
              file=sys.stderr)
    return 0 if canary_ok and shipped_ok else 1


if __name__ == "__main__":
    sys.exit(main())
