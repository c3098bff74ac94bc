"""kernels/expert_forward.py (and the Gluon kernel's host side) against a float64 oracle.

Runs in the Triton interpreter on machines without a GPU (tests/conftest.py
sets TRITON_INTERPRET=1), so shapes are small and tiles large. The oracle
loops over (head, token, k) in float64 from the [H, S, K] routing, sharing
no code with the kernel (no CSR, no tiles, no atomics).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")

import mhmoe.kernels.expert_forward as ef  # noqa: E402
import mhmoe.kernels.tuning as tuning  # noqa: E402
from mhmoe.kernels.tuning import ExpertForwardConfig, expert_forward_config, step_down  # noqa: E402
from mhmoe.reference import expert_forward_reference, sort_routes_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BIG = ExpertForwardConfig(block_m=32, block_i=32, num_warps=4, num_stages=1)


def oracle(x, probs, indices, wg, wu, wd):
    """y[s, h] = sum_k probs[h,s,k] * MLP_{h*E + indices[h,s,k]}(x[s, h]) in float64."""
    S, H, D = x.shape
    E = wg.shape[0] // H
    y = torch.zeros(S, H, D, dtype=torch.float64)
    for h in range(H):
        for s in range(S):
            for k in range(indices.shape[2]):
                f = h * E + int(indices[h, s, k])
                g = x[s, h].double() @ wg[f].double()
                u = x[s, h].double() @ wu[f].double()
                g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
                a = (g * torch.sigmoid(1.702 * g) * (u + 1.0)).to(wd.dtype).double()
                y[s, h] += float(probs[h, s, k]) * (a @ wd[f].double())
    return y


def make_problem(gen, S, H, E, K, D, I, dtype=torch.bfloat16, experts=None):
    """Random inputs; `experts` (a list of allowed expert ids) restricts the routing."""
    x = torch.randn(S, H, D, generator=gen).to(dtype)
    wg = (torch.randn(H * E, D, I, generator=gen) * D**-0.5).to(dtype)
    wu = (torch.randn(H * E, D, I, generator=gen) * D**-0.5).to(dtype)
    wd = (torch.randn(H * E, I, D, generator=gen) * I**-0.5).to(dtype)
    allowed = torch.tensor(experts if experts is not None else list(range(E)))
    picks = [allowed[torch.randperm(len(allowed), generator=gen)[:K]] for _ in range(H * S)]
    indices = torch.stack(picks).view(H, S, K) if picks else torch.zeros(H, S, K, dtype=torch.long)
    probs = torch.rand(H, S, K, generator=gen) + 0.05
    return x, probs, indices, wg, wu, wd


def run(x, probs, indices, wg, wu, wd, **kw):
    E = wg.shape[0] // x.shape[1]
    layout = sort_routes_reference(probs, indices, E)
    args = [t.to(DEVICE) for t in (x, *layout, wg, wu, wd)]
    return ef.triton_expert_forward(*args, **kw).cpu()


def rel_err(out, ref):
    denom = ref.double().norm().item()
    return (out.double() - ref.double()).norm().item() / (denom if denom > 0 else 1.0)


def check(gen, S, H, E, K, D, I, dtype=torch.bfloat16, experts=None, config=BIG, **kw):
    problem = make_problem(gen, S, H, E, K, D, I, dtype, experts)
    y = run(*problem, config=config, **kw)
    assert y.shape == (S, H, D) and y.dtype == dtype
    assert not torch.isnan(y).any()
    ref = oracle(*problem)
    # Judge against the same math done by PyTorch in fp32 with the output in
    # `dtype`: the kernel should add no error of its own beyond rounding.
    x, probs, indices, wg, wu, wd = problem
    torch_out = expert_forward_reference(x, *sort_routes_reference(probs, indices, E), wg, wu, wd)
    floor = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3}[dtype]
    assert rel_err(y, ref) <= 1.5 * rel_err(torch_out, ref) + floor / 10, (
        rel_err(y, ref), rel_err(torch_out, ref))
    assert rel_err(y, ref) <= floor
    return y


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(
    "S,H,E,K,D,I",
    [
        (7, 2, 4, 2, 32, 32),  # several heads; TMA path (D a power of two)
        (5, 1, 3, 2, 48, 32),  # D = 48, not a power of two: masked pointer path
        (6, 2, 3, 2, 32, 48),  # I = 48: the last slice of I is partial
        (1, 3, 4, 3, 16, 16),  # S = 1, the smallest D and I
        (40, 1, 2, 1, 16, 32),  # K = 1, S larger than a tile: several tiles per expert
        (4, 2, 3, 3, 16, 16),  # K = E: every expert of a head gets every token
    ],
)
def test_matches_oracle(rng, deterministic, S, H, E, K, D, I):
    check(rng, S, H, E, K, D, I, deterministic=deterministic)


def test_sigmoid_rcp_matches_oracle_and_the_division(rng):
    # ExpertForwardConfig.sigmoid_rcp: as accurate, and bitwise the division's results
    # wherever 1 + e <= 2^126 (g > -51.3, every g of these problems).
    rcp = dataclasses.replace(BIG, sigmoid_rcp=True)
    check(rng, 7, 2, 4, 2, 32, 48, config=rcp)
    problem = make_problem(torch.Generator().manual_seed(11), 9, 2, 4, 2, 32, 64)
    for deterministic in (False, True):
        assert torch.equal(run(*problem, config=rcp, deterministic=deterministic),
                           run(*problem, config=BIG, deterministic=deterministic))


def test_sigmoid_rcp_gives_zero_where_the_reciprocal_is_subnormal():
    # Every g = 16 * -1 * 3.234375 = -51.75: 1 + e = 2^127.07, whose reciprocal is
    # subnormal. The division rescales and gives g / (1 + e) (a ~ -3e-37, representable in
    # bf16, so y is tiny but not zero); the reciprocal flushes to zero (a = -0, y = 0).
    S, H, E, K, D, I = 6, 1, 2, 1, 16, 32
    gen = torch.Generator().manual_seed(4)
    x = -torch.ones(S, H, D, dtype=torch.bfloat16)
    wg = torch.full((H * E, D, I), 3.234375).bfloat16()
    wu = (torch.randn(H * E, D, I, generator=gen) * 0.1).bfloat16()
    wd = torch.randn(H * E, I, D, generator=gen).bfloat16()
    indices = torch.arange(S).remainder(E).view(H, S, K)
    probs = torch.rand(H, S, K, generator=gen) + 0.5
    problem = (x, probs, indices, wg, wu, wd)
    division = run(*problem, config=BIG)
    rcp = run(*problem, config=dataclasses.replace(BIG, sigmoid_rcp=True))
    assert torch.count_nonzero(rcp) == 0
    assert torch.count_nonzero(division) > 0 and division.abs().max() < 1e-30


@pytest.mark.parametrize("deterministic", [False, True])
def test_empty_expert(rng, deterministic):
    # Experts 1 and 3 of every head get no route.
    check(rng, 6, 2, 4, 2, 32, 32, experts=[0, 2], deterministic=deterministic)


@pytest.mark.parametrize("deterministic", [False, True])
def test_every_route_on_one_expert(rng, deterministic):
    # One expert per head takes all 70 tokens: three tiles of 32 rows, the last partial.
    check(rng, 70, 2, 3, 1, 16, 16, experts=[1], deterministic=deterministic)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dtypes(rng, dtype):
    check(rng, 5, 2, 3, 2, 32, 32, dtype=dtype)


def test_mixed_dtypes(rng):
    # fp32 activations with bf16 weights: multiplied in fp32 like the reference.
    x, probs, indices, wg, wu, wd = make_problem(rng, 5, 2, 3, 2, 32, 32)
    x = torch.randn(x.shape, generator=rng)
    y = run(x, probs, indices, wg, wu, wd, config=BIG)
    assert y.dtype == torch.float32
    # fp32 all the way but for the activation, rounded to bf16 (the weight dtype):
    # an fp32-vs-float64 difference in g or u can move that rounding by one bf16
    # step for an element near a boundary, about 1e-4 of the output at these sizes
    # (seen up to 7.7e-5). A bf16 x or output would show at 2e-3 and more.
    assert rel_err(y, oracle(x, probs, indices, wg, wu, wd)) <= 5e-4


@pytest.mark.parametrize("deterministic", [False, True])
def test_no_tokens(deterministic):
    # S = 0: no routes, nothing launched, an empty result.
    x = torch.zeros(0, 2, 16, dtype=torch.bfloat16)
    w = torch.zeros(6, 16, 16, dtype=torch.bfloat16)
    layout = sort_routes_reference(torch.zeros(2, 0, 2), torch.zeros(2, 0, 2, dtype=torch.long), 3)
    y = ef.triton_expert_forward(x, *layout, w, w, w, deterministic=deterministic)
    assert y.shape == (0, 2, 16) and y.dtype == torch.bfloat16


def test_pointer_path_forced(rng):
    # tma=False: the per-thread pointer loads, also where descriptors would work.
    check(rng, 7, 2, 3, 2, 32, 48, config=ExpertForwardConfig(32, 32, 4, 1, tma=False))


@pytest.mark.parametrize("D", [32, 256])  # 256: wider than one block of the slot-sum kernel
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("heads", [1, 2])
def test_head_groups(rng, monkeypatch, deterministic, D, heads):
    # Workspace limits of `heads` heads' buffers (1: below one head's): launches over
    # groups of that many of the 3 heads (2: a group of 2, then one of 1).
    S, K = 5, 2
    monkeypatch.setattr(tuning, "DEFAULT_WORKSPACE_BYTES", 1 if heads == 1 else heads * S * D * 4)
    monkeypatch.setattr(tuning, "DETERMINISTIC_WORKSPACE_BYTES",
                        1 if heads == 1 else heads * S * K * D * 4)
    check(rng, S, 3, 3, K, D, 16, deterministic=deterministic)


@pytest.mark.parametrize("deterministic", [False, True])
def test_finishing_tiles_can_be_forced(rng, monkeypatch, deterministic):
    # The combine's finishing kernel at tiles other than tuning's (4 pairs, 16 columns,
    # one warp: many programs, D = 48 in three column blocks): the same sums.
    monkeypatch.setattr(tuning, "slot_sum_config",
                        lambda d: tuning.SlotSumConfig(block_p=4, block_d=16, num_warps=1))
    check(rng, 7, 2, 3, 2, 48, 32, deterministic=deterministic)


def test_finishing_and_workspace_tiles():
    # The finishing kernel's columns are capped at D's next power of two; the workspace
    # limits are read at each call (what test_head_groups lowers).
    assert tuning.slot_sum_config(256) == tuning.SLOT_SUM
    assert tuning.slot_sum_config(48).block_d == 64 and tuning.slot_sum_config(16).block_d == 16
    assert tuning.combine_workspace_bytes(False) == tuning.DEFAULT_WORKSPACE_BYTES
    assert tuning.combine_workspace_bytes(True) == tuning.DETERMINISTIC_WORKSPACE_BYTES
    with pytest.raises(ValueError, match="block_p"):
        tuning.SlotSumConfig(block_p=24, block_d=16, num_warps=4)
    with pytest.raises(ValueError, match="num_warps"):
        tuning.SlotSumConfig(block_p=32, block_d=16, num_warps=3)


def test_gluon_tiles_are_checked():
    # The Gluon kernel is written for 128-route tiles, 64-wide slices and 4 warps; its
    # ring must fit shared memory beside the x tile, and its register split the launch.
    cfg = tuning.expert_forward_sm90_config()
    assert (cfg.block_m, cfg.block_i, cfg.num_warps) == (128, 64, 4)
    assert 2 * cfg.mma_regs + cfg.load_regs <= 3 * cfg.maxnreg
    for bad, match in ((dict(block_m=64), "written for"), (dict(num_stages=11), "num_stages"),
                       (dict(mma_regs=244), "mma_regs"), (dict(load_regs=16), "load_regs"),
                       (dict(maxnreg=160), "3 \\* maxnreg")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(cfg, **bad)


def test_deterministic_bitwise(rng):
    # Bitwise equal run to run and when the tokens come in another order.
    S, H, E, K = 12, 2, 4, 3
    x, probs, indices, wg, wu, wd = make_problem(rng, S, H, E, K, 32, 32)
    y1 = run(x, probs, indices, wg, wu, wd, deterministic=True, config=BIG)
    y2 = run(x, probs, indices, wg, wu, wd, deterministic=True, config=BIG)
    assert torch.equal(y1, y2)
    perm = torch.randperm(S, generator=rng)
    # The same tiles: the tiles are chosen from shapes alone, so a permutation never
    # changes them. (Another block_i splits the sum over I differently: not bitwise.)
    y3 = run(x[perm], probs[:, perm], indices[:, perm], wg, wu, wd, deterministic=True,
             config=BIG)
    assert torch.equal(y3, y1[perm])


def test_deterministic_needs_uniform_k(rng):
    x, probs, indices, wg, wu, wd = make_problem(rng, 4, 1, 3, 2, 16, 16)
    gather_ids, sorted_probs, offsets = sort_routes_reference(probs, indices, 3)
    with pytest.raises(ValueError, match="deterministic"):
        ef.triton_expert_forward(x, gather_ids[:-1], sorted_probs[:-1], offsets.clamp(max=7),
                                 wg, wu, wd, deterministic=True)


def test_configs():
    cfg = expert_forward_config(torch.device("cpu"), 24.0, 256, torch.bfloat16)
    assert isinstance(cfg, ExpertForwardConfig)
    steps, current = 0, ExpertForwardConfig(128, 64, 8, 3)
    while current is not None:
        steps, current = steps + 1, step_down(current)
    assert steps > 3  # stages, then block_i, then block_m shrink before giving up
    with pytest.raises(ValueError):
        ExpertForwardConfig(48, 32, 4, 1)


def test_hopper_table():
    # MAGI-2 rows per expert (S*K/E) at S = 1024, 4096, 16384, 32768: streaming
    # sizes keep the bulk copies for gate/up, compute-bound ones pair them.
    # Above 40 rows the Gluon kernel runs where it takes the shapes; the Triton tiles
    # beside it serve the others. Its cluster variant from 577 rows on.
    picks = [tuning.pick(tuning.FORWARD_SM90, rows) for rows in (24.0, 96.0, 384.0, 768.0)]
    assert [(c.block_m, c.paired, c.warp_specialized, c.cluster) for c in picks] == [
        (64, False, False, 1), (128, False, True, 1), (128, True, True, 1), (128, True, True, 2)]
    assert step_down(picks[-1]).paired  # shrinking keeps the choice
    with pytest.raises(ValueError, match="cluster"):
        ExpertForwardConfig(128, 32, 8, 3, cluster=2)  # clusters are the Gluon kernel's
    with pytest.raises(ValueError, match="cluster"):
        ExpertForwardConfig(128, 32, 8, 3, warp_specialized=True, cluster=4)


def test_forced_warp_specialized_refuses_shapes_it_does_not_take(rng):
    # The Gluon kernel needs an sm_90 GPU, bf16 and D = 256: a caller forcing it
    # elsewhere (here: the CPU, fp32, D = 32) gets an error, not the Triton kernel.
    problem = make_problem(rng, 8, 1, 2, 1, 32, 64, dtype=torch.float32)
    cfg = dataclasses.replace(BIG, warp_specialized=True)
    with pytest.raises(ValueError, match="warp_specialized needs an sm_90 GPU"):
        run(*problem, config=cfg)


@pytest.mark.parametrize("cluster", [1, 2])
def test_default_table_falls_back_to_triton_tiles_where_gluon_does_not_fit(rng, monkeypatch,
                                                                           cluster):
    # A default row with warp_specialized runs its Triton tiles for shapes the Gluon
    # kernel does not take (the interpreter's table never picks it; this one does).
    problem = make_problem(rng, 8, 1, 2, 1, 32, 64, dtype=torch.float32)
    ws_row = dataclasses.replace(BIG, warp_specialized=True, cluster=cluster)
    monkeypatch.setattr(tuning, "expert_forward_config", lambda *a, **k: ws_row)
    y = run(*problem)
    assert rel_err(y, oracle(*problem)) < 1e-5


PAIRED = ExpertForwardConfig(block_m=32, block_i=32, num_warps=4, num_stages=1, paired=True)


def assert_same(y, ref):
    """Equal on the CPU interpreter (same fp32 sums); on a GPU the wgmma shapes
    differ, so allow the last bit of the output dtype."""
    if DEVICE == "cpu":
        assert torch.equal(y, ref)
    else:
        assert rel_err(y, ref) <= 2e-3


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(
    "S,H,E,K,D,I",
    [
        (7, 2, 4, 2, 32, 32),  # D a power of two: W_down through a descriptor
        (5, 1, 3, 2, 48, 32),  # D = 48: masked loads of the pair and of W_down
        (6, 2, 3, 2, 32, 48),  # I = 48: the last slice of the pair is partial
        (40, 1, 2, 1, 16, 32),  # several tiles per expert
    ],
)
def test_paired_gate_up(rng, deterministic, S, H, E, K, D, I):
    # Gate and up slices as one [D, 2*block_i] operand (separate allocations).
    check(rng, S, H, E, K, D, I, deterministic=deterministic, config=PAIRED)


@pytest.mark.parametrize("up_first", [False, True])
def test_paired_one_buffer(rng, up_first):
    # Both tensors carved from one allocation, W_up before W_gate when up_first
    # (a negative distance between them).
    x, probs, indices, wg, wu, wd = make_problem(rng, 6, 2, 3, 2, 32, 48)
    buf = torch.empty((2, *wg.shape), dtype=wg.dtype)
    up_at, gate_at = (0, 1) if up_first else (1, 0)
    buf[gate_at], buf[up_at] = wg, wu
    bwg, bwu = buf[gate_at], buf[up_at]
    delta = ef._pair_delta(bwg, bwu, interpret=False)
    assert delta == (-1 if up_first else 1) * wg.numel()
    for config in (PAIRED, dataclasses.replace(PAIRED, tma=False)):
        y = run(x, probs, indices, bwg, bwu, wd, config=config)
        assert_same(y, run(x, probs, indices, wg, wu, wd, config=BIG))


def test_paired_same_tensor(rng):
    # W_up is W_gate (distance 0): still one operand, both halves the same.
    x, probs, indices, wg, _, wd = make_problem(rng, 5, 2, 3, 2, 32, 32)
    y = run(x, probs, indices, wg, wg, wd, config=PAIRED)
    assert_same(y, run(x, probs, indices, wg, wg, wd, config=BIG))


def test_pair_delta_fallback(rng):
    # Pairs the kernel cannot load as one operand fall back to two dots.
    wg = torch.randn(6, 16, 32).to(torch.bfloat16)
    buf = torch.randn(6 * 16 * 32 + 8).to(torch.bfloat16)
    shifted = buf[8:].view(6, 16, 32)  # 8 elements (16 bytes) from its neighbour: not 16
    assert ef._pair_delta(buf[:-8].view(6, 16, 32), shifted, interpret=False) is None
    assert ef._pair_delta(wg, wg.float(), interpret=False) is None  # two dtypes
    assert ef._pair_delta(wg, wg.transpose(1, 2).contiguous().transpose(1, 2),
                          interpret=False) is None  # not contiguous
    assert ef._pair_delta(wg, wg.clone(), interpret=False) is not None
    # The fallback computes the same numbers as the unpaired kernel.
    x, probs, indices, _, _, wd = make_problem(rng, 5, 2, 3, 2, 16, 32)
    w2 = torch.randn(2 * 6 * 16 * 32 + 8).to(torch.bfloat16)
    g2, u2 = w2[:6 * 16 * 32].view(6, 16, 32), w2[6 * 16 * 32 + 8:].view(6, 16, 32)
    assert ef._pair_delta(g2, u2, interpret=False) is None
    y = run(x, probs, indices, g2, u2, wd, config=PAIRED)
    assert_same(y, run(x, probs, indices, g2, u2, wd, config=BIG))


def test_cluster_tensor_maps_refuse_a_first_call_under_graph_capture(monkeypatch):
    # The cluster variant's tensor maps are encoded on the host and copied once per weights;
    # a first call inside a CUDA graph capture would record that copy: an error says to
    # warm up first (the maps of weights seen before are reused without a copy).
    from mhmoe.kernels import expert_forward_sm90 as ws

    w = torch.zeros(2, 256, 64, dtype=torch.bfloat16)
    wd = torch.zeros(2, 64, 256, dtype=torch.bfloat16)
    box = tuning.expert_forward_sm90_config().block_i
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="warm-up"):
        ws.cached_tensor_maps(w, w, wd, box)
    key = (box, *((t.device, t.data_ptr(), tuple(t.shape)) for t in (w, w, wd)))
    monkeypatch.setitem(ws._TENSOR_MAPS, key, "maps made before")
    assert ws.cached_tensor_maps(w, w, wd, box) == "maps made before"


def test_cluster_launch_setup_finds_offsets_once_and_refuses_unknown_launchers(monkeypatch):
    # `_cluster_kernel` (host side of the cluster variant) with the JIT and the driver
    # stubbed: the first compile's barrier offsets are passed back in and checked in a
    # second compile; the launch becomes a cluster launch once; later calls only look the
    # kernel up; a launcher metadata it does not know is refused rather than patched.
    import types

    import triton

    from mhmoe.kernels import expert_forward_sm90 as ws

    def llir(ready, peer):
        init = ('call void asm sideeffect "@$0 mbarrier.init.shared::cta.b64 [$1], {}'
                ';", "b,r"(i1 %p, ptr addrspace(3) getelementptr (i8, ptr addrspace(3) '
                '@global_smem, i32 {}))')
        return "\n".join((init.format(1, ready), init.format(2, 999), init.format(1, peer)))

    compiled, calls = {}, []

    def warmup(*args, grid, **opts):
        calls.append((opts["READY_OFF"], opts["PEER_FREE_OFF"]))
        key = (opts["READY_OFF"], opts["PEER_FREE_OFF"])
        if key not in compiled:
            compiled[key] = types.SimpleNamespace(
                asm={"llir": llir(229616, 229776)}, packed_metadata=(12, 1, 229912),
                metadata=types.SimpleNamespace(shared=229912, global_scratch_size=0,
                                               profile_scratch_size=0),
                function=7, _init_handles=lambda: None)
        return compiled[key]

    monkeypatch.setattr(ws._expert_forward_sm90_kernel, "warmup", warmup)
    utils = types.SimpleNamespace(cuOccupancyMaxActiveClusters=lambda f, shared, c: 66)
    monkeypatch.setattr(triton.runtime.driver, "_active",
                        types.SimpleNamespace(utils=utils), raising=False)
    monkeypatch.setattr(type(triton.runtime.driver), "active",
                        property(lambda self: self._active), raising=False)
    monkeypatch.setattr(ws, "_OFFSETS", {})
    args = (torch.zeros(1),)
    opts = dict(I=1280, DETERMINISTIC=False, NSTAGE=10, CLUSTER=2)
    k, o = ws._cluster_kernel(args, opts)
    assert calls == [(0, 0), (229616, 229776)]
    assert (o["READY_OFF"], o["PEER_FREE_OFF"]) == (229616, 229776)
    assert k.packed_metadata == (12, 2, 229912) and k.mhmoe_fit == 66
    k2, _ = ws._cluster_kernel(args, opts)
    assert k2 is k and calls[-1] == (229616, 229776) and len(calls) == 3
    assert k.packed_metadata == (12, 2, 229912)  # not doubled on later calls
    monkeypatch.setattr(ws, "_OFFSETS", {})
    compiled.clear()
    bad = warmup(*args, grid=(1,), **dict(opts, READY_OFF=229616, PEER_FREE_OFF=229776))
    bad.packed_metadata = (12, 1, 229912, "new field")
    compiled[(0, 0)] = bad
    with pytest.raises(RuntimeError, match="cluster launch"):
        ws._cluster_kernel(args, opts)
