"""Experiment (routing v12): a persistent logits kernel, with Triton's Hopper warp
specialisation over its tile loop, against the default `_logits_route_kernel`.

The question: the default kernel's epilogue (the shortlist, ~85 us at S = 32768, NOTES
routing v11) runs beside nobody's tensor work. With `tl.range(..., warp_specialize=True)`
Triton 3.6 makes a copying warpgroup and two computing ones that take half the rows of a
tile each and run out of lockstep, so one's epilogue could run under the other's MMAs.

    python3 benchmarks/experiments/logits_ws.py --compile-only       # here, no GPU
    PYTHONPATH=src python3 benchmarks/experiments/logits_ws.py OUT.json   # on the H200

The GPU run checks the logits, shortlists and counts bitwise against the default
kernel's, then times both (and the whole route + layout) interleaved.
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))
from router_inputs import experiment_main

from mhmoe.kernels import routing as R


@triton.jit
def _logits_persistent_kernel(
    x_desc, w_desc, l_desc, logits_ptr, bias_ptr, counts_ptr, short_ptr, S, H, NB,
    E: tl.constexpr, D: tl.constexpr, TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    COUNT_T: tl.constexpr, SHORT: tl.constexpr, WS: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    TMA_STORE: tl.constexpr,
):
    """The split logits kernel's work (ROUTE=False, bulk stores in column halves, counts
    cleared, shortlists) over tiles (b, h, n), tile t = (b * H + h) * NSPLIT + n, program p
    taking t = p, p + NUM_PROGRAMS, ..."""
    NSPLIT: tl.constexpr = E // BLOCK_N
    num_tiles = tl.cdiv(S, BLOCK_S) * H * NSPLIT
    for t in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, warp_specialize=WS):
        n = t % NSPLIT
        h = (t // NSPLIT) % H
        b = t // (NSPLIT * H)
        n0 = n * BLOCK_N
        s0 = b * BLOCK_S
        acc = tl.zeros([BLOCK_S, BLOCK_N], dtype=tl.float32)
        # One loop of one dot a step (Triton 3.6's warp specialisation fails on two dots
        # a step): the default kernel's order, w3 and w2 of each K step, then w1.
        NSTEP: tl.constexpr = D // BLOCK_D
        for j in range(0, 3 * NSTEP):
            small = j < 2 * NSTEP
            d0 = tl.where(small, j // 2, j - 2 * NSTEP) * BLOCK_D
            part = tl.where(small, 2 - j % 2, 0)
            xt = x_desc.load([s0, h * D + d0])
            acc = tl.dot(xt, w_desc.load([(part * H + h) * E + n0, d0]).T, acc)
        if TMA_STORE:
            lo, hi = acc.reshape(BLOCK_S, 2, BLOCK_N // 2).permute(0, 2, 1).split()
            l_desc.store([h, s0, n0], lo.reshape(1, BLOCK_S, BLOCK_N // 2))
            l_desc.store([h, s0, n0 + BLOCK_N // 2], hi.reshape(1, BLOCK_S, BLOCK_N // 2))
        else:
            # (Triton 3.6's warp specialisation fails on bulk stores.)
            rows = s0 + tl.arange(0, BLOCK_S)
            base = logits_ptr + (h.to(tl.int64) * S + rows.to(tl.int64)) * E + n0
            tl.store(base[:, None] + tl.arange(0, BLOCK_N)[None, :], acc,
                     mask=(rows < S)[:, None])
        NJ: tl.constexpr = (BLOCK_S + COUNT_T - 1) // COUNT_T
        first = s0 + tl.arange(0, NJ) * COUNT_T
        clear = (first % COUNT_T == 0) & (first < S)
        row = (h * NB + first // COUNT_T).to(tl.int64)
        tl.store(counts_ptr + row[:, None] * E + n0 + tl.arange(0, BLOCK_N)[None, :],
                 tl.zeros([NJ, BLOCK_N], tl.int32), mask=clear[:, None])
        R._write_shortlist(acc, s0, h, n, bias_ptr, short_ptr, S, E, TOP_K, SHORT, BLOCK_S,
                           BLOCK_N, HAS_BIAS, R.SIGMOID_APPROX_ERROR, False)


BLOCK_S, BLOCK_D, BLOCK_N, COUNT_T = 128, 32, 128, 64
H, E, D, K = 12, 256, 256, 6


def constexprs(ws: bool, programs: int, tma_store: bool) -> dict:
    return dict(E=E, D=D, TOP_K=K, HAS_BIAS=True, BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D,
                BLOCK_N=BLOCK_N, COUNT_T=COUNT_T, SHORT=R.shortlist_size(K, BLOCK_N), WS=ws,
                NUM_PROGRAMS=programs, TMA_STORE=tma_store)


# (warp specialised, bulk stores): the variants that compile with Triton 3.6
VARIANTS = ((False, True), (False, False), (True, False))


def compile_only() -> None:
    import re
    import subprocess
    import tempfile

    from mhmoe.kernels.sass_audit import compile_sm90, toolchain
    sig = {"x_desc": f"tensordesc<bf16[{BLOCK_S}, {BLOCK_D}]>",
           "w_desc": f"tensordesc<bf16[{BLOCK_N}, {BLOCK_D}]>",
           "l_desc": f"tensordesc<fp32[1, {BLOCK_S}, {BLOCK_N // 2}]>", "logits_ptr": "*fp32",
           "bias_ptr": "*fp32", "counts_ptr": "*i32", "short_ptr": "*i32", "S": "i32",
           "H": "i32", "NB": "i32"}
    for ws, tma in (*VARIANTS, (True, True)):
        for stages in (2, 3):
            try:
                k = compile_sm90(_logits_persistent_kernel, sig, constexprs(ws, 132, tma), 4,
                                 stages, ("S",))
            except Exception as e:
                print(f"ws={ws} tma_store={tma} stages={stages}: FAILED {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:300]}")
                continue
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                f.write(k.asm["ptx"])
            info = subprocess.run([toolchain()[0], "-v", "-arch=sm_90a", f.name, "-o",
                                   os.devnull], capture_output=True, text=True).stderr
            os.unlink(f.name)
            regs = re.findall(r"Used (\d+) registers", info)
            spills = re.findall(r"(\d+) bytes spill stores", info)
            print(f"ws={ws} tma_store={tma} stages={stages}: warps {k.metadata.num_warps}, "
                  f"registers {regs}, shared {k.metadata.shared} B, spill stores {spills} B")


def launch(x, parts, bias, logits, counts, short, ws: bool, programs: int, stages: int,
           tma: bool):
    from triton.tools.tensor_descriptor import TensorDescriptor
    S = x.shape[0]
    x_desc = TensorDescriptor.from_tensor(x.view(S, H * D), [BLOCK_S, BLOCK_D])
    w_desc = TensorDescriptor.from_tensor(parts.view(3 * H * E, D), [BLOCK_N, BLOCK_D])
    l_desc = TensorDescriptor.from_tensor(logits, [1, BLOCK_S, BLOCK_N // 2])
    _logits_persistent_kernel[(programs,)](
        x_desc, w_desc, l_desc, logits, bias, counts, short, S, H, counts.shape[1],
        **constexprs(ws, programs, tma), num_warps=4, num_stages=stages)


def gpu(out_path: str) -> None:
    from router_inputs import router_inputs
    from triton.testing import do_bench, do_bench_cudagraph

    dev = torch.device("cuda")
    torch.manual_seed(0)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    mm = do_bench(lambda: a @ a, warmup=50, rep=300)
    x, gate, bias, kw = router_inputs(dev)
    S = x.shape[0]
    cfg = R.logits_route_config(dev)
    result = {"bf16_matmul_tflops": 2 * 8192**3 / mm / 1e9, "S": S, "variants": {}}
    # The default kernel's outputs, through its launcher (logits, shortlists, counts).
    probs, indices, logits_ref, counts_ref = R.triton_logits_route(
        x, gate, return_logits=True, config=cfg, **kw)
    parts = R.split_router_weight(gate)
    NB = counts_ref.shape[1]
    short_ref = torch.empty(H, S, 16, device=dev, dtype=torch.int32)
    # the default kernel's shortlist, straight from its launch
    x_desc = R.TensorDescriptor.from_tensor(x.view(S, H * D), [BLOCK_S, BLOCK_D])
    w_desc = R.TensorDescriptor.from_tensor(parts.view(3 * H * E, D), [BLOCK_N, BLOCK_D])
    bias_c = bias.contiguous()

    def default_kernel(logits, counts, short):
        R._logits_route_kernel[(triton.cdiv(S, BLOCK_S), H * (E // BLOCK_N))](
            x_desc, w_desc, logits, bias_c, probs, indices, counts, S, H, NB, E, 1e-12, 4.9,
            E=E, D=D, TOP_K=K, SOFTMAX=False, HAS_BIAS=True, ROUTE_NORM=True, NUM_GROUPS=1,
            TOPK_GROUPS=1, BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D, BLOCK_K=8, BLOCK_G=1,
            WRITE_LOGITS=True, FROM_TILE=False, INTERPRET=False, ROUTE=False, COUNT_T=COUNT_T,
            HALF_STORES=True, BLOCK_N=BLOCK_N,
            l_desc=R.TensorDescriptor.from_tensor(logits, [1, BLOCK_S, BLOCK_N // 2]),
            short_ptr=short, SHORT=8, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    counts0 = torch.full_like(counts_ref, 7)
    logits0 = torch.full_like(logits_ref, float("nan"))
    default_kernel(logits0, counts0, short_ref)
    assert torch.equal(logits0, logits_ref) and not counts0.any()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    variants = {"default": lambda lg, c, s: default_kernel(lg, c, s)}
    for ws, tma in VARIANTS:
        for mult in ((1, 2) if ws else (1, 2, 3)):
            for stages in (2, 3):
                name = (f"persistent ws={int(ws)} tma_store={int(tma)} programs={mult}x{sms} "
                        f"stages={stages}")
                variants[name] = (lambda lg, c, s, ws=ws, p=mult * sms, st=stages, tma=tma:
                                  launch(x, parts, bias_c, lg, c, s, ws, p, st, tma))
    for name, fn in variants.items():
        rec = {}
        try:
            lg = torch.full_like(logits_ref, float("nan"))
            c = torch.full_like(counts_ref, 7)
            sh = torch.full_like(short_ref, 12345)
            fn(lg, c, sh)
            torch.cuda.synchronize()
            rec["bitwise"] = bool(torch.equal(lg, logits_ref) and not c.any() and
                                  torch.equal(sh, short_ref))
            def call(fn=fn, lg=lg, c=c, sh=sh):
                fn(lg, c, sh)
            rec["ms"] = [do_bench(call, warmup=20, rep=200) for _ in range(3)]
            rec["graph_ms"] = do_bench_cudagraph(call, rep=200)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        result["variants"][name] = rec
        print(name, rec, flush=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    experiment_main(compile_only, gpu)
