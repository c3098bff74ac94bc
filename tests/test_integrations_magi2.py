"""mhmoe.integrations.magi2: the published MAGI-2 MoE modules, accelerated in place.

The published module is played by `magi2_standin.Magi2MultiHeadMoE`, written from
docs/contract.md section 9 alone; every check of outputs and gradients is against that
module's own forward (its class's `forward`, which `accelerate` shadows and `restore`
gives back).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import mhmoe
from magi2_standin import (
    DEFAULT_EP_GROUP,
    Magi2EPGroup,
    Magi2MultiHeadMoE,
    Magi2MultiHeadMoEConfig,
)
from mhmoe.integrations import magi2

TRAINABLE = ("gate", "W_gate", "W_up", "W_down")

# Largest |accelerated - stand-in| over the largest |stand-in|, outputs and gradients.
# float32: both sum the same fp32 products (in other orders). bfloat16: both round the
# activation and the output to bf16 at the same points, so an fp32 summation order that
# flips one rounding moves a value by a bf16 step (2^-8 relative); the stand-in's
# autograd also rounds the activation's gradient to bf16 where mhmoe's backward does not.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def magi2_config(heads: int = 6, head_dim: int = 8, experts: int = 4, top_k: int = 2,
                 inter: int = 16, dtype: torch.dtype = torch.float32,
                 **fields) -> Magi2MultiHeadMoEConfig:
    # route_scale 2.5, not the dataclass default: a lost scale shows in every output
    fields.setdefault("route_scale", 2.5)
    return Magi2MultiHeadMoEConfig(heads * head_dim, heads, experts, top_k, inter, dtype,
                                   **fields)


def random_standin(cfg: Magi2MultiHeadMoEConfig, gen: torch.Generator,
                   ep_group: Magi2EPGroup | None = None) -> Magi2MultiHeadMoE:
    """A one-rank module with random parameters (the two biases differ, so the bias
    source shows; W_gate and W_up large enough that some gate values pass the clamp)."""
    module = Magi2MultiHeadMoE(cfg, ep_group=ep_group)
    D, I = module.d_head, module.d_expert
    scale = {"gate": D ** -0.5, "W_gate": 1.0, "W_up": 1.0, "W_down": I ** -0.5,
             "router.expert_bias": 0.1, "router.expert_bias_ema": 0.1}
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * scale[name])
    return module


def rank_module(full: Magi2MultiHeadMoE, ep_group: Magi2EPGroup) -> Magi2MultiHeadMoE:
    """The module of one rank, loaded as the model's loader does: each full tensor through
    its parameter's `mmap_weight_transform`."""
    module = Magi2MultiHeadMoE(full.config, ep_group=ep_group)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(param.mmap_weight_transform(full.get_parameter(name)))
    return module


def forward_backward(module: nn.Module, x: torch.Tensor, cotangent: torch.Tensor,
                     **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """y = module(x) and the gradients of <y, cotangent> in x and the trainable parameters."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = module(x, **kwargs)
    (y.float() * cotangent).sum().backward()
    grads = {"x": x.grad if x.grad is not None else torch.zeros_like(x)}
    for name in TRAINABLE:
        param = module.get_parameter(name)
        grads[name] = param.grad if param.grad is not None else torch.zeros_like(param)
    return y.detach(), grads


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    if want.numel() == 0:
        return 0.0
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def compare(got: tuple, want: tuple) -> dict[str, float]:
    """{"y": ..., "x": ..., "gate": ..., ...}: rel_diff of the output and every gradient."""
    (y, grads), (y_ref, grads_ref) = got, want
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    return {"y": rel_diff(y, y_ref)} | {n: rel_diff(grads[n], grads_ref[n]) for n in grads_ref}


def own_forward(module: Magi2MultiHeadMoE):
    """The stand-in's own forward, whatever instance attribute shadows it."""
    return lambda x, **kwargs: Magi2MultiHeadMoE.forward(module, x, **kwargs)


class Block(nn.Module):
    """A model block holding a MoE module as the published model does, among others."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(moe.config.hidden_size)
        self.mlp = nn.ModuleDict({"moe_mlp": moe})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp["moe_mlp"](self.norm(x))


# ----------------------------------------------------------------------------------------
# The config mapping
# ----------------------------------------------------------------------------------------


def test_config_from_magi2_maps_every_field():
    published = Magi2MultiHeadMoEConfig(3072, 12, 256, 6, 1280, torch.bfloat16, "sigmoid", True,
                                        4.9)
    cfg = magi2.config_from_magi2(published)
    assert cfg == mhmoe.MAGI2_PREVIEW
    assert cfg.norm_eps == 1e-12 and cfg.deterministic is False and cfg.bias_source == "ema"
    # route_scale is carried as it is: the published default 1.0 stays 1.0
    plain = magi2.config_from_magi2(Magi2MultiHeadMoEConfig(64, 4, 8, 2, 32, torch.float32,
                                                            "softmax", False))
    assert (plain.route_scale, plain.score_func, plain.route_norm, plain.params_dtype) == \
        (1.0, "softmax", False, torch.float32)
    named = dataclasses.replace(published, params_dtype="torch.float16")
    assert magi2.config_from_magi2(named).params_dtype == torch.float16


@dataclasses.dataclass(frozen=True)
class ConfigWithCapacity(Magi2MultiHeadMoEConfig):
    capacity_factor: float = 1.25


@pytest.mark.parametrize("published, match", [
    (magi2_config(score_func="tanh"), "score_func"),
    (magi2_config(top_k=5), "top_k"),
    (dataclasses.replace(magi2_config(), hidden_size=50), "divisible"),
    (magi2_config(dtype=torch.int8), "params_dtype"),
    (ConfigWithCapacity(48, 6, 4, 2, 16, torch.float32), "capacity_factor"),
    (object(), "lacks the published fields"),
])
def test_config_from_magi2_refuses_what_mhmoe_cannot_represent(published, match):
    with pytest.raises(ValueError, match=match):
        magi2.config_from_magi2(published)


# ----------------------------------------------------------------------------------------
# What accelerate keeps and changes
# ----------------------------------------------------------------------------------------


def test_accelerate_keeps_class_parameters_hooks_and_state_dict(rng):
    cfg = magi2_config()
    model = nn.Sequential(Block(random_standin(cfg, rng)), nn.Linear(48, 48),
                          Block(random_standin(cfg, rng)))
    moes = [m for m in model.modules() if isinstance(m, Magi2MultiHeadMoE)]
    params = dict(model.named_parameters())
    pointers = {name: p.data_ptr() for name, p in params.items()}
    keys = list(model.state_dict())
    submodules = [name for name, _ in model.named_modules()]
    before = [(m.config, m.ep_group, m.ep_slice,
               {n: p.mmap_weight_transform for n, p in m.named_parameters()}) for m in moes]
    calls = []
    moes[0].register_forward_hook(lambda *args: calls.append("hook"))

    assert magi2.accelerate(model) == 2
    assert magi2.accelerate(model) == 0  # already accelerated: not counted twice
    for m, (config, group, ep_slice, hooks) in zip(moes, before, strict=True):
        assert type(m) is Magi2MultiHeadMoE and isinstance(m, Magi2MultiHeadMoE)
        assert m.config is config and m.ep_group is group and m.ep_slice == ep_slice
        assert {n: p.mmap_weight_transform for n, p in m.named_parameters()} == hooks
        layer = magi2.accelerated_layer(m)
        assert isinstance(layer, mhmoe.MultiHeadMoE)
        # the same Parameter objects, nothing else: no copy, no buffer, no extra memory
        assert {id(p) for p in layer.parameters()} == {id(p) for p in m.parameters()}
        assert list(layer.buffers()) == []
        assert layer.router.expert_bias is m.router.expert_bias
        assert layer.router.expert_bias_ema is m.router.expert_bias_ema
    assert dict(model.named_parameters()) == params
    assert {name: p.data_ptr() for name, p in params.items()} == pointers
    assert list(model.state_dict()) == keys
    assert [name for name, _ in model.named_modules()] == submodules
    model(torch.randn(3, 48, generator=rng))
    assert calls == ["hook"]  # module hooks run around the accelerated forward

    assert magi2.restore(model) == 2
    assert magi2.restore(model) == 0
    assert all("forward" not in m.__dict__ and magi2.accelerated_layer(m) is None for m in moes)
    assert list(model.state_dict()) == keys
    # the model itself can be the module
    assert magi2.accelerate(moes[0]) == 1 and magi2.restore(moes[0]) == 1


def test_modules_without_the_interface_are_left_alone(rng):
    class OtherSharded(nn.Linear):
        _EP_SHARDED_PARAMETER_NAMES = frozenset({"weight"})

    model = nn.Sequential(OtherSharded(4, 4), mhmoe.MultiHeadMoE(
        magi2.config_from_magi2(magi2_config())), random_standin(magi2_config(), rng))
    assert magi2.accelerate(model) == 1
    assert magi2.accelerated_layer(model[0]) is None and "forward" not in model[1].__dict__


# One process: (config fields, input shape, parameter dtype). route_scale 2.5 in all.
ONE_PROCESS = [
    pytest.param({}, (2, 7), torch.float32, id="sigmoid-norm-batched"),
    pytest.param({"score_func": "softmax", "route_norm": False}, (7,), torch.float32,
                 id="softmax-no-norm"),
    pytest.param({"top_k": 4}, (5,), torch.float32, id="K=E"),  # edge: every expert picked
    # edge: one head, K=1, D not a power of two (no route_norm: with it, K=1 makes every
    # probability route_scale and the gate's gradient zero up to rounding)
    pytest.param({"heads": 1, "top_k": 1, "head_dim": 12, "route_norm": False}, (6,),
                 torch.float32, id="one-head-K=1"),
    pytest.param({}, (1,), torch.float32, id="S=1"),  # edge: one token
    pytest.param({}, (0,), torch.float32, id="S=0"),  # edge: no tokens
    pytest.param({}, (9,), torch.bfloat16, id="bf16"),
    pytest.param({"score_func": "softmax"}, (3, 4), torch.bfloat16, id="bf16-softmax"),
]


@pytest.mark.parametrize("fields, lead, dtype", ONE_PROCESS)
def test_forward_and_gradients_match_the_standin(rng, fields, lead, dtype):
    module = random_standin(magi2_config(dtype=dtype, **fields), rng)
    hidden = module.config.hidden_size
    x = torch.randn(*lead, hidden, generator=rng).to(dtype)
    cotangent = torch.randn(*lead, hidden, generator=rng)
    want = forward_backward(module, x, cotangent)
    assert magi2.accelerate(module) == 1
    got = forward_backward(module, x, cotangent)
    diffs = compare(got, want)
    assert max(diffs.values()) <= TOL[dtype], diffs
    # restore: the stand-in's own forward, bit for bit
    assert magi2.restore(module) == 1
    assert torch.equal(forward_backward(module, x, cotangent)[0], want[0])


def test_replicated_sequence_on_one_rank(rng):
    module = random_standin(magi2_config(), rng, Magi2EPGroup(replicated_sequence=True))
    x = torch.randn(5, 48, generator=rng)
    cotangent = torch.randn(5, 48, generator=rng)
    want = forward_backward(module, x, cotangent)
    magi2.accelerate(module)
    assert magi2.accelerated_layer(module).input_mode == "replicated"
    diffs = compare(forward_backward(module, x, cotangent), want)
    assert max(diffs.values()) <= TOL[torch.float32], diffs


def test_default_group_object(rng):
    # Built without ep_group: the model's default group object (one rank, sequence input).
    module = random_standin(magi2_config(), rng)
    assert module.ep_group is DEFAULT_EP_GROUP
    x = torch.randn(4, 48, generator=rng)
    want = module(x)
    magi2.accelerate(module)
    assert rel_diff(module(x), want) <= TOL[torch.float32]
    # an ep_group of None reads as the same default
    module.ep_group = None
    assert magi2.accelerated_layer(module).partition == mhmoe.HeadPartition(6)
    assert rel_diff(module(x), want) <= TOL[torch.float32]


def test_replaced_parameters_and_group_are_rebound(rng):
    module = random_standin(magi2_config(), rng)
    magi2.accelerate(module)
    x = torch.randn(6, 48, generator=rng)
    module.W_up = nn.Parameter(torch.randn(module.W_up.shape, generator=rng))
    module.router.expert_bias_ema = nn.Parameter(
        torch.randn(module.router.expert_bias_ema.shape, generator=rng), requires_grad=False)
    assert rel_diff(module(x), own_forward(module)(x)) <= TOL[torch.float32]
    layer = magi2.accelerated_layer(module)
    assert layer.W_up is module.W_up and layer.router.expert_bias_ema is \
        module.router.expert_bias_ema
    module.ep_group = Magi2EPGroup(replicated_sequence=True)
    assert magi2.accelerated_layer(module).input_mode == "replicated"
    assert rel_diff(module(x), own_forward(module)(x)) <= TOL[torch.float32]


def test_a_replaced_config_is_seen_even_at_a_reused_address(rng):
    # The layer is bound to the module's config object. The first replacement frees that
    # object, and the second may be allocated at its address (CPython reuses freed blocks;
    # of many candidates, the one that landed there is taken when there is one): the
    # module must run the newest config, not the layer built from the freed one.
    module = random_standin(magi2_config(), rng)
    x = torch.randn(6, 48, generator=rng)
    magi2.accelerate(module)
    module(x)
    bound = id(module.config)
    module.config = dataclasses.replace(module.config, route_scale=1.5)  # nothing else holds either
    candidates = [dataclasses.replace(module.config, route_scale=1.0 + i / 1024)
                  for i in range(1024)]
    module.config = next((c for c in candidates if id(c) == bound), candidates[-1])
    del candidates
    assert magi2.accelerated_layer(module).config.route_scale == module.config.route_scale
    assert rel_diff(module(x), own_forward(module)(x)) <= TOL[torch.float32]


# ----------------------------------------------------------------------------------------
# The environment variables
# ----------------------------------------------------------------------------------------


def test_router_bias_source_main_changes_selection_as_published(rng, monkeypatch):
    module = random_standin(magi2_config(), rng)
    with torch.no_grad():  # the main bias favours the last expert of every head strongly
        module.router.expert_bias.view(6, 4)[:, 3] = 5.0
    x = torch.randn(8, 48, generator=rng)
    magi2.accelerate(module)
    ema = module(x)
    assert rel_diff(ema, own_forward(module)(x)) <= TOL[torch.float32]
    monkeypatch.setenv("MAGI2_ROUTER_BIAS_SOURCE", "main")
    main = module(x)
    assert rel_diff(main, own_forward(module)(x)) <= TOL[torch.float32]
    assert rel_diff(main, ema) > 1e-2  # the selection changed
    _, indices = magi2.accelerated_layer(module).route_heads(x.view(8, 6, 8))
    assert (indices == 3).any(-1).all()  # every (head, token) picks the favoured expert
    monkeypatch.setenv("MAGI2_ROUTER_BIAS_SOURCE", "bogus")
    with pytest.raises(ValueError, match="MAGI2_ROUTER_BIAS_SOURCE"):
        module(x)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors on the triton path need the interpreter")
def test_deterministic_env_takes_the_deterministic_kernel(rng, monkeypatch):
    # The fused kernels under the interpreter (D and I multiples of 16): MAGI2_DETERMINISTIC=1
    # reaches the expert kernel as deterministic=True, and the result repeats bit for bit.
    import mhmoe.kernels.expert_forward as ef

    seen = []
    real = ef.triton_expert_forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("deterministic"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ef, "triton_expert_forward", spy)
    module = random_standin(magi2_config(heads=2, head_dim=16, inter=32), rng)
    x = torch.randn(5, 32, generator=rng)
    want = module(x)
    magi2.accelerate(module, backend="triton")
    assert rel_diff(module(x), want) <= TOL[torch.float32]
    monkeypatch.setenv("MAGI2_DETERMINISTIC", "1")
    assert magi2.accelerated_layer(module).deterministic is True
    first, second = module(x), module(x)
    assert torch.equal(first, second)
    assert rel_diff(first, want) <= TOL[torch.float32]
    assert seen == [False, True, True]


# ----------------------------------------------------------------------------------------
# The loader's hooks, and what cannot be accelerated
# ----------------------------------------------------------------------------------------


def test_loader_hooks_still_slice_rows_after_accelerate(rng):
    # 4 heads of 3 experts on 3 ranks pad to 6 heads, 2 per rank: rank 1 owns heads 2-3,
    # rank 2 only padding (zeros). group None: modules that hold a rank's rows, as a loader
    # builds them; they cannot run a sequence-parallel forward.
    cfg = magi2_config(heads=4, experts=3)
    full = random_standin(cfg, rng)
    for rank in range(3):
        module = Magi2MultiHeadMoE(cfg, ep_group=Magi2EPGroup(3, rank))
        assert magi2.accelerate(module) == 1
        for name, param in module.named_parameters():
            whole = full.get_parameter(name).detach()
            rows = whole[rank * 6:rank * 6 + 6]
            expected = torch.cat([rows, whole.new_zeros(6 - rows.shape[0], *whole.shape[1:])])
            assert torch.equal(param.mmap_weight_transform(whole), expected), (rank, name)
            local = torch.randn(param.shape, generator=rng)
            assert param.mmap_weight_transform(local) is local  # local rows: as they are
        with pytest.raises(ValueError, match="without a process group"):
            module(torch.zeros(2, 32))


def test_a_replicated_rank_runs_without_a_process_group(rng):
    # Replicated input needs no communication: a rank's module with group None runs its
    # own heads (rank 1 of 2: heads 3-5 of 6), as the stand-in's own forward does.
    full = random_standin(magi2_config(), rng)
    module = rank_module(full, Magi2EPGroup(2, 1, None, True))
    x = torch.randn(5, 3 * 8, generator=rng)
    cotangent = torch.randn(5, 3 * 8, generator=rng)
    want = forward_backward(module, x, cotangent)
    magi2.accelerate(module)
    diffs = compare(forward_backward(module, x, cotangent), want)
    assert max(diffs.values()) <= TOL[torch.float32], diffs


def _bf16_router(module):
    module.gate.data = module.gate.data.bfloat16()


def _shifted_start(module):
    module.local_head_start = 1


def _other_rows(module):
    module.W_down = nn.Parameter(torch.zeros(module.W_down.shape[0] + 1, *module.W_down.shape[1:]))


def _plain_tensor(module):
    del module.W_up
    module.W_up = torch.zeros(module.W_gate.shape)


def _mixed_experts(module):
    module.W_up.data = module.W_up.data.double()


def _bad_group(module):
    module.ep_group = object()


def _fp8_experts(module):
    # published fp8 weights carry no per-row scales: mhmoe's fp8 experts cannot take them
    for name in ("W_gate", "W_up", "W_down"):
        getattr(module, name).data = getattr(module, name).data.to(torch.float8_e4m3fn)


@pytest.mark.parametrize("mutate, match", [
    (lambda m: setattr(m, "config", dataclasses.replace(m.config, score_func="tanh")),
     "score_func"),
    (_bf16_router, "router must be float32"),
    (_shifted_start, "local_head_start=1"),
    (_other_rows, "W_down is"),
    (_plain_tensor, "not an nn.Parameter"),
    (_mixed_experts, "differ in dtype"),
    (_bad_group, "lacks the published members"),
    (_fp8_experts, "1-byte"),
])
def test_errors_name_the_module_and_change_nothing(rng, mutate, match):
    cfg = magi2_config()
    model = nn.ModuleDict({"blocks": nn.ModuleList([Block(random_standin(cfg, rng))
                                                    for _ in range(3)])})
    mutate(model.blocks[1].mlp.moe_mlp)
    with pytest.raises(ValueError, match=match) as error:
        magi2.accelerate(model)
    assert "'blocks.1.mlp.moe_mlp'" in str(error.value)
    # checked before anything changed: no module was accelerated
    assert all(magi2.accelerated_layer(m) is None for m in model.modules())


def test_a_module_broken_after_accelerate_fails_on_its_next_call(rng):
    module = random_standin(magi2_config(), rng)
    magi2.accelerate(module)
    module.config = dataclasses.replace(module.config, top_k=9)
    with pytest.raises(ValueError, match=r"'\(the model itself\)'.*top_k"):
        module(torch.zeros(2, 48))


# ----------------------------------------------------------------------------------------
# Head parallelism: 2 and 3 gloo processes with the published group object
# ----------------------------------------------------------------------------------------

# world -> cases (config fields, parameter dtype, per-rank token counts). 4 heads on 3
# ranks pad to 6: rank 2 owns none; 5 heads on 3 ranks: rank 2 owns one and one padding.
GLOO_CASES = {
    2: [({"heads": 4}, torch.float32, [5, 2]),
        ({"heads": 6, "score_func": "softmax"}, torch.float32, [0, 3]),  # a rank with none
        ({"heads": 4}, torch.bfloat16, [4, 3])],
    3: [({"heads": 4}, torch.float32, [0, 4, 3]),
        ({"heads": 5}, torch.float32, [2, 3, 1]),
        ({"heads": 5}, torch.bfloat16, [3, 0, 2])],
}


@pytest.mark.parametrize("world", sorted(GLOO_CASES))
def test_head_parallel_gloo(tmp_path, world):
    seed = int(os.environ["MHMOE_TEST_SEED"]) + world
    mp.spawn(gloo_rank, args=(world, str(tmp_path / "init"), seed, str(tmp_path)),
             nprocs=world, join=True)
    for rank in range(world):
        report = json.loads((tmp_path / f"magi2_rank{rank}.json").read_text())
        assert len(report) == len(GLOO_CASES[world]), report
        for case in report:
            flags = case.pop("flags")
            assert all(flags.values()), (rank, case["case"], flags)
            tol = TOL[getattr(torch, case.pop("dtype"))]
            bad = {k: v for k, v in case["diffs"].items() if not v <= tol}
            assert not bad, (rank, case["case"], bad)


def gloo_rank(rank: int, world: int, init_file: str, seed: int, out_dir: str) -> None:
    """One rank of `test_head_parallel_gloo`: writes its report to magi2_rank{rank}.json."""
    # Imported before the group exists (see mhmoe.launch.join_launched_group): otherwise
    # torch._dynamo, imported on the first torch.library call, keeps the group alive and
    # gloo's teardown aborts the process now and then.
    import torch._dynamo

    from dist_worker import leave_process, leave_together

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        report = [check_rank(rank, world, seed + i, *case)
                  for i, case in enumerate(GLOO_CASES[world])]
        leave_together()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"magi2_rank{rank}.json"), "w") as f:
        json.dump(report, f)
    leave_process()


def check_rank(rank: int, world: int, seed: int, fields: dict, dtype: torch.dtype,
               counts: list[int]) -> dict:
    """Both input modes on this rank: the accelerated module against the stand-in's own
    forward (outputs and gradients), and the stand-in against one process."""
    gen = torch.Generator().manual_seed(seed)
    full = random_standin(magi2_config(dtype=dtype, **fields), gen)
    cfg = full.config
    D = full.d_head
    x_all = torch.randn(sum(counts), cfg.hidden_size, generator=gen).to(dtype)
    cot_all = torch.randn(sum(counts), cfg.hidden_size, generator=gen)
    begin = sum(counts[:rank])
    mine = slice(begin, begin + counts[rank])
    one_process = forward_backward(full, x_all, cot_all)
    diffs, flags = {}, {}

    # Sequence-parallel: this rank's tokens, all heads; the module gathers the counts.
    module = rank_module(full, Magi2EPGroup(world, rank, dist.group.WORLD))
    x, cot = x_all[mine], cot_all[mine]
    own = forward_backward(module, x, cot)
    y_full, g_full = one_process
    standin = {"y": rel_diff(own[0], y_full[mine]), "x": rel_diff(own[1]["x"], g_full["x"][mine])}
    standin |= {n: rel_diff(own[1][n], module.ep_slice(g_full[n])) for n in TRAINABLE}
    diffs |= {f"standin-vs-one-process:{k}": v for k, v in standin.items()}
    flags["accelerate"] = magi2.accelerate(module) == 1
    accelerated = forward_backward(module, x, cot)
    diffs |= {f"sequence:{k}": v for k, v in compare(accelerated, own).items()}
    flags["counts passed in"] = torch.equal(module(x, token_counts=counts).detach(),
                                            accelerated[0])
    flags["restore"] = magi2.restore(module) == 1
    flags["restored bitwise"] = torch.equal(forward_backward(module, x, cot)[0], own[0])

    # Replicated sequence: every token on every rank, only this rank's heads.
    module = rank_module(full, Magi2EPGroup(world, rank, dist.group.WORLD, True))
    Hl, start = module.local_num_heads, module.local_head_start
    heads = torch.zeros(sum(counts), module.padded_num_heads, D, dtype=dtype)
    heads[:, :cfg.num_heads] = x_all.view(-1, cfg.num_heads, D)
    x = heads[:, start:start + Hl].reshape(sum(counts), Hl * D)
    cot = torch.randn(x.shape, generator=gen)
    own = forward_backward(module, x, cot)
    magi2.accelerate(module)
    diffs |= {f"replicated:{k}": v for k, v in compare(forward_backward(module, x, cot),
                                                       own).items()}
    try:
        module(torch.zeros(2, cfg.hidden_size + D, dtype=dtype))
        flags["replicated width checked"] = False
    except ValueError as err:
        flags["replicated width checked"] = "replicated input must be" in str(err)
    return {"case": f"{fields} {dtype} {counts}", "dtype": str(dtype).removeprefix("torch."),
            "diffs": diffs, "flags": flags}
