"""fp8 (e4m3) expert weights: the scheme, its PyTorch twin, and `quantize(layer, "fp8")`.

The scheme (docs/contract.md section 10; why this granularity: docs/fp8.md):

- weights: `torch.float8_e4m3fn` with one fp32 scale per expert output channel,
  `W = W_fp8 * scale`: W_gate and W_up [F, D, I] with scales [F, I] (over D),
  W_down [F, I, D] with scales [F, D] (over I); scale = max(amax, AMAX_FLOOR) / 448.
- activations (every product runs on the fp8 tensor cores): x per route row
  (scale over its D values), the SwiGLU7 output per route row and per block of
  ACT_BLOCK consecutive columns of I; dynamic scales from the values themselves
  (amax / 448), applied to the fp32 accumulators.
- everything else as in the bf16 layer: fp32 router on the unquantized x, fp32
  accumulation, SwiGLU7 on the fp32 accumulators, fp32 combine.

`fp8_expert_reference` computes the same quantization with float64 math: the
kernel's oracle, and the PyTorch path of `experts.expert_forward_fp8`.

A layer holds fp8 experts when its `params_dtype` is `FP8` (`MultiHeadMoE` builds one
directly, `quantize(layer, "fp8")` makes one from a bf16 layer): W_gate, W_up and
W_down as e4m3 parameters stored K-major (`empty_k_major`, `k_major`: the layout the
kernel reads without a copy), beside them the fp32 scales `W_gate_scale` [F, I],
`W_up_scale` [F, I] and `W_down_scale` [F, D]; in a checkpoint `NAME_scale` beside
`NAME`, the scheme (`SCHEME`) in the metadata. Inference only: fp8 weights have no
gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from .reference import swiglu7_reference

if TYPE_CHECKING:
    from .layer import MultiHeadMoE

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 2.0 ** -64
ACT_BLOCK = 64
SCHEME = "fp8-e4m3fn/weights:per-output-channel/activations:per-row,per-row-64-block"
# The schemes `quantize` knows, and the names of the scales beside the weights.
SCHEMES = ("fp8",)
SCALE_NAMES = {"W_gate": "W_gate_scale", "W_up": "W_up_scale", "W_down": "W_down_scale"}
# The scale of an all-zero channel (a padding head's rows): what `row_scales` gives it.
ZERO_SCALE = AMAX_FLOOR / FP8_MAX
# Elements quantized at a time by `quantize_into` (whole experts): bounds its fp32
# temporaries to a few hundred MB whatever the layer's size.
CHUNK_ELEMENTS = 1 << 26
INFERENCE_ONLY = ("fp8 expert weights are inference only (no gradients): run the layer under "
                  "torch.no_grad() or torch.inference_mode() with an input that does not "
                  "require grad; train the bf16 layer and quantize it")


def row_scales(values: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 scales max(amax, AMAX_FLOOR) / 448 of `values` reduced over `dim`
    (computed in fp32, as the kernel does)."""
    amax = values.abs().amax(dim=dim).to(torch.float32)
    return amax.clamp_min(AMAX_FLOOR) / FP8_MAX


def to_fp8(values: torch.Tensor, scales: torch.Tensor, dim: int) -> torch.Tensor:
    """values / scales (broadcast over `dim`) rounded to e4m3 (nearest even, saturated)."""
    return (values.to(torch.float32) / scales.unsqueeze(dim)).to(FP8)


class Fp8Weights(NamedTuple):
    """Quantized expert weights. w_gate, w_up: [F, D, I] e4m3; w_down: [F, I, D] e4m3;
    gate_scale, up_scale: [F, I] fp32; down_scale: [F, D] fp32."""

    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    gate_scale: torch.Tensor
    up_scale: torch.Tensor
    down_scale: torch.Tensor

    def dequantized(self, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
        """(W_gate, W_up, W_down) as `dtype` values of W_fp8 * scale."""
        return (self.w_gate.to(dtype) * self.gate_scale.to(dtype).unsqueeze(1),
                self.w_up.to(dtype) * self.up_scale.to(dtype).unsqueeze(1),
                self.w_down.to(dtype) * self.down_scale.to(dtype).unsqueeze(1))


def row_chunks(rows: int, row_elements: int, chunk_elements: int = CHUNK_ELEMENTS) \
        -> list[tuple[int, int]]:
    """[begin, end) runs of whole rows (experts) of about `chunk_elements` elements each,
    covering `rows`."""
    step = max(1, chunk_elements // max(1, row_elements))
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def is_k_major(w: torch.Tensor) -> bool:
    """Whether w [F, K, N] is stored K-major (a transposed view of a contiguous
    [F, N, K] tensor), the layout the fp8 kernel reads without a copy."""
    return w.transpose(1, 2).is_contiguous()


def k_major(w: torch.Tensor) -> torch.Tensor:
    """w [F, K, N] stored K-major: w itself if it is, else a K-major copy (same shape
    and values)."""
    return w if is_k_major(w) else w.transpose(1, 2).contiguous().transpose(1, 2)


def empty_k_major(shape: tuple[int, int, int], device: torch.device | str | None = None) \
        -> torch.Tensor:
    """An uninitialised e4m3 tensor of `shape` [F, K, N], stored K-major."""
    F, K, N = shape
    return torch.empty(F, N, K, dtype=FP8, device=device).transpose(1, 2)


def quantize_into(values: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
    """Per-output-channel e4m3 of `values` [F, K, N] (any float dtype) written into
    `out` (e4m3 [F, K, N], any strides: the layer's K-major views) and `scales`
    (fp32 [F, N]), a chunk of experts at a time, on their device (every expert is
    quantized on its own)."""
    for begin, end in row_chunks(values.shape[0], values[0].numel() if len(values) else 1):
        piece = values[begin:end]
        s = row_scales(piece, 1)
        out[begin:end].copy_(to_fp8(piece, s, 1))
        scales[begin:end].copy_(s)


def quantize_weights(w_gate: torch.Tensor, w_up: torch.Tensor,
                     w_down: torch.Tensor) -> Fp8Weights:
    """Per-output-channel e4m3 of the expert weights (any float dtype, any device):
    `quantize_into` K-major outputs.

    w_gate, w_up: [F, D, I]; w_down: [F, I, D]. The fp8 tensors have the shapes given,
    stored K-major (`empty_k_major`: W_gate/W_up as [F, I, D], W_down as [F, D, I] in
    memory), the layout the kernel reads.
    """
    out = []
    for w in (w_gate, w_up, w_down):
        q = empty_k_major(tuple(w.shape), w.device)
        scale = torch.empty(w.shape[0], w.shape[2], dtype=torch.float32, device=w.device)
        quantize_into(w, q, scale)
        out.append((q, scale))
    (wg, sg), (wu, su), (wd, sd) = out
    return Fp8Weights(wg, wu, wd, sg, su, sd)


def fp8_expert_reference(x_heads: torch.Tensor, gather_ids: torch.Tensor,
                         sorted_probs: torch.Tensor, offsets: torch.Tensor,
                         weights: Fp8Weights, *, act_block: int = ACT_BLOCK) -> torch.Tensor:
    """The fp8 expert computation with float64 math (the kernel's twin).

    x_heads: [S, H, D]; the layout as `expert_forward`'s. Returns float64 [S, H, D].
    x is quantized per row, the SwiGLU7 output per row and per `act_block` columns,
    as the kernel does. Reads `offsets` on the host.
    """
    S, H, D = x_heads.shape
    F, _, I = weights.w_gate.shape
    E = F // H
    y = torch.zeros(S, H, D, dtype=torch.float64, device=x_heads.device)
    bounds = offsets.tolist()
    for f in range(F):
        lo, hi = bounds[f], bounds[f + 1]
        if lo == hi:
            continue
        h = f // E
        # This expert's weights only: a whole layer in float64 would be 8x its fp8 bytes.
        wg, wu, wd = Fp8Weights(*(t[f:f + 1] for t in weights)).dequantized(torch.float64)
        wg, wu, wd = wg[0], wu[0], wd[0]
        tokens = gather_ids[lo:hi].long()
        x = x_heads[tokens, h].to(torch.float32)
        s_x = row_scales(x, 1)
        x = to_fp8(x, s_x, 1).to(torch.float64) * s_x.to(torch.float64)[:, None]
        a = swiglu7_reference(x @ wg, x @ wu)
        out = torch.zeros(hi - lo, D, dtype=torch.float64, device=x.device)
        for i0 in range(0, I, act_block):
            piece = a[:, i0:i0 + act_block].to(torch.float32)
            s_a = row_scales(piece, 1)
            q = to_fp8(piece, s_a, 1).to(torch.float64)
            out += (q @ wd[i0:i0 + act_block]) * s_a.to(torch.float64)[:, None]
        y[tokens, h] += out * sorted_probs[lo:hi].to(torch.float64)[:, None]
    return y


def quantize(layer: MultiHeadMoE, scheme: str = "fp8") -> MultiHeadMoE:
    """A new `MultiHeadMoE` with the experts of `layer` quantized by `scheme` ("fp8":
    e4m3 weights with per-output-channel fp32 scales, this module's scheme).

    The new layer has the same config but `params_dtype=FP8`, the same head partition,
    process group, backend, input mode and router (gate and biases copied, fp32), and
    lives on the layer's device; the weights are quantized there a chunk of experts at
    a time. `layer` is left untouched (no parameter is changed, moved or shared). The
    new layer is inference only: it has no trainable parameters.
    """
    from .layer import MultiHeadMoE

    if not isinstance(layer, MultiHeadMoE):
        raise TypeError(f"quantize: expected a MultiHeadMoE, got {type(layer).__name__}")
    if scheme not in SCHEMES:
        raise ValueError(f"quantize: unknown scheme {scheme!r}; known: {list(SCHEMES)}")
    if layer.W_gate.dtype == FP8:
        raise ValueError("quantize: the layer's experts are already fp8 (float8_e4m3fn); "
                         "quantize the bf16 layer it came from")
    device = layer.W_gate.device
    if device.type == "meta":
        raise ValueError("quantize: the layer is on the meta device (its weights have no "
                         "values); load or initialise it first")
    config = layer.config.replace(params_dtype=FP8)
    new = MultiHeadMoE(config, layer.group, device="meta", backend=layer.backend,
                       partition=layer.partition, input_mode=layer.input_mode,
                       fused_router=layer.fused_router)
    new.to_empty(device=device)
    with torch.no_grad():
        new.gate.copy_(layer.gate)
        new.router.expert_bias.copy_(layer.router.expert_bias)
        new.router.expert_bias_ema.copy_(layer.router.expert_bias_ema)
        for name, scale in SCALE_NAMES.items():
            quantize_into(getattr(layer, name), getattr(new, name), getattr(new, scale))
    return new
