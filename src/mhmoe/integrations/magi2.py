"""Run the published MAGI-2 model's MoE layers on mhmoe (docs/contract.md section 9).

    from mhmoe.integrations import magi2

    model = ...                      # built and loaded as usual, published classes and loader
    n = magi2.accelerate(model)      # its n MoE modules now run mhmoe
    y = model(...)
    magi2.restore(model)             # the published forward again

A published MoE module is recognised by its interface, never by importing the published
package: its class carries `_EP_SHARDED_PARAMETER_NAMES` naming (at least) the six
parameters of section 5, and it has a `config` with the published fields
(`config_from_magi2`), an `ep_group` (world_size, rank, group, replicated_sequence) and
those parameters with this rank's rows.

What `accelerate` changes, per module, and nothing else:

- an instance attribute `forward`, which shadows the class's forward (the class, and so
  `isinstance`, is untouched; no import-time patching of anything);
- an instance attribute holding a `mhmoe.MultiHeadMoE` built on the meta device whose
  parameters are the module's own Parameter objects: no copy, no extra memory. It is a
  plain attribute, not a registered submodule, so `state_dict()`, `parameters()`,
  `named_modules()` and `.to()` see the module exactly as before.

The module keeps its config, `ep_group`, `ep_slice` and each parameter's
`mmap_weight_transform` (they are its own objects, untouched), so the model's loader still
finds it with `isinstance` and still slices checkpoint rows through it. Every call checks
(by identity, against references the binding keeps, so that a freed object's reused
address cannot pass for it) that the module still holds the same parameters, config and
group; if one was replaced (an assignment, `load_state_dict(..., assign=True)`, a `.to()`
that swaps parameters, a fresh `ep_group`), the mhmoe layer is rebuilt around the new ones.

The accelerated forward is `MultiHeadMoE.forward`: sequence-parallel input (the token
counts gathered with one collective per call, as the published module does, unless
`token_counts=` is passed) or, with `ep_group.replicated_sequence`, replicated input; the
environment variables `MAGI2_ROUTER_BIAS_SOURCE` (main|ema) and `MAGI2_DETERMINISTIC`
(1|0) are read on every call.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..checkpoint.format import MOE_PARAM_NAMES, expected_dtypes, expected_shapes
from ..config import MultiHeadMoEConfig
from ..layer import MultiHeadMoE
from ..parallel import HeadPartition

__all__ = ["accelerate", "accelerated_layer", "config_from_magi2", "is_magi2_moe", "restore"]

# The per-expert parameters of a published module (docs/contract.md section 5) are
# MOE_PARAM_NAMES; its expert weights, of one dtype, are these.
_EXPERT_WEIGHTS = ("W_gate", "W_up", "W_down")

# The fields of the published `Magi2MultiHeadMoEConfig`, in its order.
PUBLISHED_CONFIG_FIELDS = ("hidden_size", "num_heads", "num_experts", "top_k",
                           "expert_intermediate_size", "params_dtype", "score_func",
                           "route_norm", "route_scale")

# The instance attribute holding a module's `_Binding` (its presence marks it accelerated).
_STATE = "_mhmoe_magi2"


def config_from_magi2(published_config: Any) -> MultiHeadMoEConfig:
    """The `MultiHeadMoEConfig` of a published `Magi2MultiHeadMoEConfig`: the one mapping.

    hidden_size, num_heads, num_experts, top_k, expert_intermediate_size, score_func,
    route_norm -> the fields of the same names, unchanged.
    params_dtype -> params_dtype (a torch.dtype; a name such as "bfloat16" is read as one).
    route_scale -> route_scale, unchanged: a published default of 1.0 is not "corrected"
        to MAGI-2 Preview's 4.9, since the drop-in must compute what the module computes.
    The fields the published config does not have take the published behaviour:
    bias_source="ema" (MAGI2_ROUTER_BIAS_SOURCE, read on every call, overrides it, as in
    the published module); num_groups=1, topk_groups=1 (no group-limited routing);
    norm_eps=1e-12 (the published constant); deterministic=False (MAGI2_DETERMINISTIC,
    read on every call, overrides it).

    Raises ValueError for a config mhmoe cannot represent: a published field missing,
    a dataclass field beyond the nine (mhmoe cannot tell what it would change), or
    values `MultiHeadMoEConfig` rejects (its message names the field).
    """
    kind = type(published_config).__name__
    missing = [name for name in PUBLISHED_CONFIG_FIELDS if not hasattr(published_config, name)]
    if missing:
        raise ValueError(f"config_from_magi2: {kind} lacks the published fields {missing}")
    if dataclasses.is_dataclass(published_config):
        extra = sorted({f.name for f in dataclasses.fields(published_config)}
                       - set(PUBLISHED_CONFIG_FIELDS))
        if extra:
            raise ValueError(f"config_from_magi2: {kind} has fields {extra} beyond the published "
                             f"{list(PUBLISHED_CONFIG_FIELDS)}; mhmoe cannot represent them")
    fields = {name: getattr(published_config, name) for name in PUBLISHED_CONFIG_FIELDS}
    fields["params_dtype"] = _as_dtype(fields["params_dtype"])
    return MultiHeadMoEConfig(**fields, bias_source="ema", num_groups=1, topk_groups=1,
                              norm_eps=1e-12, deterministic=False)


def is_magi2_moe(module: nn.Module) -> bool:
    """Whether `module` claims the published MoE interface: its class's
    `_EP_SHARDED_PARAMETER_NAMES` names the six parameters of section 5. (Other
    expert-parallel modules with their own sharded names are not MoE layers.)"""
    names = getattr(type(module), "_EP_SHARDED_PARAMETER_NAMES", None)
    try:
        return set(MOE_PARAM_NAMES) <= set(names)
    except TypeError:
        return False


def accelerate(model: nn.Module, *, backend: str = "auto") -> int:
    """Make every published MAGI-2 MoE module in `model` (itself included) run mhmoe.

    backend: the `MultiHeadMoE` backend ("auto": Triton kernels on CUDA, PyTorch elsewhere).
    returns the number of modules changed by this call; modules accelerated before are
    left as they are and not counted (`restore` first to change their backend).

    Every module is checked and its mhmoe layer built before any is changed: on an error
    (a ValueError naming the module's path, e.g. a config mhmoe cannot represent) `model`
    is left as it was.
    """
    bindings = [(module, _bind(module, path, backend, module.__dict__.get("forward")))
                for path, module in model.named_modules()
                if is_magi2_moe(module) and _STATE not in module.__dict__]
    for module, binding in bindings:
        module.__dict__[_STATE] = binding
        module.__dict__["forward"] = types.MethodType(_accelerated_forward, module)
    return len(bindings)


def restore(model: nn.Module) -> int:
    """Undo `accelerate`: the modules run their class's forward again (or the instance
    `forward` they had before `accelerate`). returns the number of modules restored."""
    restored = 0
    for _, module in model.named_modules():
        binding = module.__dict__.pop(_STATE, None)
        if binding is None:
            continue
        module.__dict__.pop("forward", None)
        if binding.previous_forward is not None:
            module.__dict__["forward"] = binding.previous_forward
        restored += 1
    return restored


def accelerated_layer(module: nn.Module) -> MultiHeadMoE | None:
    """The `MultiHeadMoE` an accelerated module runs (sharing its parameters), rebuilt
    first if the module's parameters, config or group were replaced; None if `module`
    is not accelerated."""
    if _STATE not in module.__dict__:
        return None
    return _current(module).layer


@dataclass(frozen=True)
class _Binding:
    """An accelerated module's mhmoe layer, and what it was built from."""

    path: str                     # the module's path in the model, for error messages
    backend: str
    layer: MultiHeadMoE           # meta-built, holding the module's own parameters
    signature: _Signature         # what `layer` was built from
    previous_forward: Callable | None  # an instance `forward` the module had before


def _accelerated_forward(module: nn.Module, x: torch.Tensor,
                         token_counts: list[int] | None = None) -> torch.Tensor:
    """The forward of an accelerated module: x [..., hidden] (replicated mode:
    [..., local_heads * D]) -> same shape and dtype. `token_counts` (an mhmoe extension;
    sequence mode): every rank's token count, which spares the per-call gather. A module
    of more than one rank without `ep_group.group` runs in the replicated mode only (the
    layer refuses a sequence-parallel forward: it needs the group's all-to-all)."""
    return _current(module).layer(x, token_counts=token_counts)


def _current(module: nn.Module) -> _Binding:
    """The module's binding, rebuilt if its parameters, config or group changed."""
    binding = module.__dict__[_STATE]
    if not binding.signature.matches(_Signature.of(module)):
        binding = _bind(module, binding.path, binding.backend, binding.previous_forward)
        module.__dict__[_STATE] = binding
    return binding


@dataclass(frozen=True, eq=False)
class _Signature:
    """What an mhmoe layer was built from: cheap enough to compare on every call.

    The objects themselves are kept, not their `id()`: a replaced config or group that
    nothing else holds is freed, and a newer one may be allocated at its address.
    """

    objects: tuple  # the six parameters, the config, ep_group and its process group
    values: tuple   # the parameters' dtypes (a cast in place keeps the Parameter
                    # objects) and ep_group's world_size, rank and replicated_sequence

    @staticmethod
    def of(module: nn.Module) -> _Signature:
        params = tuple(_lookup(module, name) for name in MOE_PARAM_NAMES)
        group = getattr(module, "ep_group", None)
        world, rank, process_group, replicated = (getattr(group, name, None)
                                                  for name in _GROUP_FIELDS)
        return _Signature((*params, getattr(module, "config", None), group, process_group),
                          (*(getattr(p, "dtype", None) for p in params), world, rank,
                           replicated))

    def matches(self, other: _Signature) -> bool:
        return all(a is b for a, b in zip(self.objects, other.objects, strict=True)) \
            and self.values == other.values


# The members of a published ep_group object.
_GROUP_FIELDS = ("world_size", "rank", "group", "replicated_sequence")


def _lookup(module: nn.Module, dotted: str) -> Any:
    owner = module
    for part in dotted.split("."):
        owner = getattr(owner, part, None)
    return owner


def _bind(module: nn.Module, path: str, backend: str,
          previous_forward: Callable | None) -> _Binding:
    """Check `module` against the published interface and build its mhmoe layer on the
    meta device around the module's own parameters. ValueError naming `path` if the
    module cannot run on mhmoe. `previous_forward`: the instance `forward` that
    `restore` puts back (None: the class's)."""
    where = f"magi2: module {path or '(the model itself)'!r} ({type(module).__name__})"
    signature = _Signature.of(module)
    try:
        config = config_from_magi2(getattr(module, "config", None))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    extra = sorted(set(type(module)._EP_SHARDED_PARAMETER_NAMES) - set(MOE_PARAM_NAMES))
    if extra:
        raise ValueError(f"{where}: sharded parameters {extra} beyond the published "
                         f"{list(MOE_PARAM_NAMES)}; mhmoe cannot represent them")
    group = getattr(module, "ep_group", None)
    if group is None:  # the published default: one rank, sequence input
        world, rank, process_group, replicated = 1, 0, None, False
    else:
        missing = [name for name in _GROUP_FIELDS if not hasattr(group, name)]
        if missing:
            raise ValueError(f"{where}: its ep_group ({type(group).__name__}) lacks the "
                             f"published members {missing}")
        world, rank, process_group, replicated = (getattr(group, name)
                                                  for name in _GROUP_FIELDS)
        replicated = bool(replicated)
    try:
        partition = HeadPartition(config.num_heads, int(world), int(rank))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    _check_attributes(module, where, config, partition)
    params = {name: _lookup(module, name) for name in MOE_PARAM_NAMES}
    _check_parameters(params, where, config, partition)
    if not callable(getattr(module, "ep_slice", None)):
        raise ValueError(f"{where}: no ep_slice method (docs/contract.md section 9)")
    # The experts' dtype is the parameters' own (a cast may have changed it since the
    # config was written); the router is checked above to have the dtype that goes with it.
    config = config.replace(params_dtype=params["W_gate"].dtype)
    try:
        layer = MultiHeadMoE(config, process_group, device="meta", backend=backend,
                             partition=partition,
                             input_mode="replicated" if replicated else "sequence")
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    for name, param in params.items():
        owner, _, attr = name.rpartition(".")
        setattr(layer.get_submodule(owner) if owner else layer, attr, param)
    return _Binding(path, backend, layer, signature, previous_forward)


def _check_attributes(module: nn.Module, where: str, config: MultiHeadMoEConfig,
                      partition: HeadPartition) -> None:
    """The module's published attributes must agree with section 6's partition of the
    config's heads: otherwise it holds other heads than mhmoe would compute."""
    expected = {
        "num_heads": config.num_heads,
        "num_experts": config.num_experts,
        "top_k": config.top_k,
        "d_head": config.head_dim,
        "d_expert": config.expert_intermediate_size,
        "padded_num_heads": partition.padded_heads,
        "local_num_heads": partition.local_heads,
        "local_flatten_num_experts": partition.local_heads * config.num_experts,
        "ep_pad_heads": partition.padded_heads - config.num_heads,
        "local_head_start": partition.start,
        "has_real_moe_heads": partition.real_heads > 0,
    }
    wrong = {name: (getattr(module, name), value) for name, value in expected.items()
             if hasattr(module, name) and getattr(module, name) != value}
    if wrong:
        detail = ", ".join(f"{name}={got!r} (section 6 gives {want!r})"
                           for name, (got, want) in wrong.items())
        raise ValueError(f"{where}: its attributes disagree with its config and ep_group: "
                         f"{detail}")


def _check_parameters(params: dict[str, Any], where: str, config: MultiHeadMoEConfig,
                      partition: HeadPartition) -> None:
    """The six parameters: nn.Parameters of this rank's shapes (the checkpoint format's
    `expected_shapes`), experts of one floating dtype of 2 bytes or more, and the router
    dtype (`expected_dtypes`) that goes with it: float32 (float64 with float64 experts)."""
    shapes = expected_shapes(config, partition.local_heads * config.num_experts)
    for name, param in params.items():
        if not isinstance(param, nn.Parameter):
            raise ValueError(f"{where}: {name} is {type(param).__name__}, not an nn.Parameter")
        if tuple(param.shape) != shapes[name]:
            raise ValueError(f"{where}: {name} is {list(param.shape)}, expected "
                             f"{list(shapes[name])} for rank {partition.rank} of "
                             f"{partition.world_size}")
        if not param.dtype.is_floating_point:
            raise ValueError(f"{where}: {name} is {param.dtype}, not floating point "
                             f"(quantized published weights cannot run on mhmoe's experts)")
        if name in _EXPERT_WEIGHTS and param.dtype.itemsize == 1:
            # mhmoe's fp8 experts need per-row scales (docs/fp8.md) the published module
            # does not have; without this check the layer would fail at its first forward.
            raise ValueError(f"{where}: {name} is {param.dtype}, a 1-byte (fp8) dtype: "
                             f"published fp8 weights cannot run on mhmoe's experts, which "
                             f"need per-row scales (docs/fp8.md)")
    experts = {params[name].dtype for name in _EXPERT_WEIGHTS}
    if len(experts) != 1:
        raise ValueError(f"{where}: W_gate, W_up and W_down differ in dtype: "
                         f"{sorted(map(str, experts))}")
    dtypes = expected_dtypes(config.replace(params_dtype=experts.pop()))
    for name in ("gate", "router.expert_bias", "router.expert_bias_ema"):
        if params[name].dtype != dtypes[name]:
            want = str(dtypes[name]).removeprefix("torch.")
            raise ValueError(f"{where}: {name} is {params[name].dtype}; the router must be "
                             f"{want} with {params['W_gate'].dtype} experts "
                             f"(docs/contract.md section 2: fp32 logits)")


def _as_dtype(value: Any) -> Any:
    """A published params_dtype as a torch.dtype: a dtype, or a name such as "bfloat16"
    or "torch.bfloat16" (anything else is left for MultiHeadMoEConfig to reject)."""
    if isinstance(value, str):
        named = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(named, torch.dtype):
            return named
    return value
