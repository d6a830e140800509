"""fp8 frozen base weights for LoRA runs: half the bytes of bf16 for every frozen linear of the blocks.

Each frozen nn.Linear weight inside `transformer.blocks` and VACE's context blocks `vace_blocks` (peft's `base_layer`
under a LoRA, and the linears peft did not wrap) is stored as float8 e4m3 with one fp32 scale per output channel:
    scale_o = max_i |W_oi| / 448        (448: e4m3's largest finite value; an all-zero row gets scale 1)
    Q_oi    = round_e4m3(W_oi / scale_o)
and the forward computes in the compute dtype (bf16 under CUDA autocast, else the input's: fp32 on the CPU) with
W' = Q · scale, dequantized per layer on the fly, so only one layer's W' exists at a time. The backward dequantizes
again instead of keeping W' (nn.Linear's autograd would save the dequantized weight for the input gradient: every
layer's bf16 copy alive until backward, the saving gone). Biases, norms, the patch/time/text/image embeddings,
scale_shift_tables, the output head (norm_out, proj_out) and the LoRA weights keep their dtypes.

Error: e4m3 has 3 mantissa bits, so a weight in its normal range (|W/scale| >= 2^-6) is off by at most 2^-4 of
itself (half a unit in the last place); below that the spacing is 2^-9, so at most scale · 2^-10 absolutely
(tests/test_fp8.py asserts |W' - W| <= 2^-4 |W| + 2^-10 scale).

Optional fp8 matmul (scaled_mm=True, CUDA with compute capability >= 9.0, bf16; --fp8-matmul): the input is
quantized per row (token) to e4m3 as well and torch._scaled_mm multiplies the two fp8 operands with row-wise scales,
accumulating in fp32. An H100's fp8 peak is twice its bf16 peak; frozen weights need no weight gradient, so the
forward (and its recomputation) is 1/2 (2/3 with recomputation) of the linears' FLOPs, at the price of the
activations' e4m3 rounding too (2.6% RMS relative). The backward stays a bf16 matmul on the dequantized weight: the
weight's per-channel scale lies along the contraction dimension of grad_out @ W, which row-wise scaling cannot
express. Its numerics are tested on the CPU (torch's CPU _scaled_mm); its speed on an H100 is not measured yet,
so it is off by default.

Like torchao's Float8WeightOnlyConfig (per-channel e4m3, matmul in the high precision) and musubi-tuner's
fp8_scaled (per-channel scales, dequantize in the linear's forward), without a new dependency: a frozen weight
needs only storage and a cast. Exported LoRAs hold lora_A/lora_B alone (a2/train/lora.py), so they load on the bf16
base.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from a2.fake import fake_mode_active

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W (out, in) -> (Q e4m3 (out, in), scale fp32 (out,)) with W ~= Q · scale[:, None] (module docstring)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    if not fake_mode_active() and not torch.isfinite(amax).all():  # (a dry run's fake weights have no values)
        raise ValueError(f"{int((~torch.isfinite(amax)).sum())} rows with non-finite weights: cannot quantize")
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    # the clamp only catches amax / (amax / 448) rounding a hair above 448; e4m3fn has no inf, it would become NaN
    return (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Q · scale in `dtype` (e4m3 values are exact in bf16; the product rounds once, 2^-9 relative in bf16). In place
    on a fresh copy: one weight-sized temporary, not two (A2-14B's FFN weight: 141 MB in bf16)."""
    return q.to(dtype, copy=True).mul_(scale.to(dtype)[:, None])


class _DequantLinear(torch.autograd.Function):
    """y = x @ (Q·s)^T + b; saves Q and s (the stored fp8 weight, no new memory), not the dequantized W."""

    @staticmethod
    def forward(ctx, x, q, scale, bias):
        ctx.save_for_backward(q, scale)
        return F.linear(x, dequantize(q, scale, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out):
        q, scale = ctx.saved_tensors
        grad_x = grad_out @ dequantize(q, scale, grad_out.dtype) if ctx.needs_input_grad[0] else None
        grad_b = grad_out.flatten(0, -2).sum(0) if ctx.needs_input_grad[3] else None
        return grad_x, None, None, grad_b


class _ScaledMMLinear(_DequantLinear):
    """Forward with both operands in e4m3 (input per row, weight per output channel) through torch._scaled_mm;
    backward as _DequantLinear."""

    @staticmethod
    def forward(ctx, x, q, scale, bias):
        ctx.save_for_backward(q, scale)
        x2 = x.reshape(-1, x.shape[-1])
        x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp(min=1e-12)
        xq = (x2 / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        # _scaled_mm wants the second operand column-major: Q^T of a row-major Q is exactly that, no copy
        y = torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=scale[None, :].float(), out_dtype=x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], q.shape[0])


def scaled_mm_supported(device: torch.device) -> bool:
    """Row-wise scaled fp8 matmuls: CUDA compute capability 9.0+ (H100/H200; torch._scaled_mm's row-wise path)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


class Fp8Linear(nn.Linear):
    """A frozen nn.Linear whose weight is an e4m3 Parameter (requires_grad=False) with a `scale` buffer (fp32, one
    per output channel). Made by `quantize_base_weights` from an nn.Linear in place, so peft's lora.Linear, which
    calls self.base_layer(x), and every other reference keep working. The input gets its gradient; the weight none."""

    scale: torch.Tensor
    scaled_mm: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        x = x.to(dtype)
        if (self.scaled_mm and x.is_cuda and dtype == torch.bfloat16 and x.shape[-1] % 16 == 0
                and self.out_features % 16 == 0):
            return _ScaledMMLinear.apply(x, self.weight, self.scale, bias)
        return _DequantLinear.apply(x, self.weight, self.scale, bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", weight=float8_e4m3fn per-channel{', scaled_mm' if self.scaled_mm else ''}"


def base_linears(transformer: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of the base linears of the blocks (and VACE's context blocks), those fp8 applies to: peft's
    base_layer and the linears peft did not wrap; not the LoRA matrices (peft's lora_A/lora_B dicts) and nothing
    outside the blocks (embeddings, head). By name, not requires_grad, so that a plan can count them on a model not
    yet frozen."""
    return [(f"{group}.{name}", m) for group in ("blocks", "vace_blocks") if hasattr(transformer, group)
            for name, m in getattr(transformer, group).named_modules()
            if isinstance(m, nn.Linear) and not any(part.startswith("lora_") for part in name.split("."))]


def fp8_bytes(weight: torch.Tensor) -> float:
    """Bytes of a frozen linear weight stored as e4m3 with one fp32 scale per output channel."""
    return weight.numel() + 4.0 * weight.shape[0]


def fp8_bytes_saved(transformer: nn.Module) -> int:
    """GPU bytes quantize_base_weights saves on this model as it is now (0 once quantized): per weight its bytes
    less its fp8_bytes. Works on a model on any device, the meta device included, so that a memory plan can count it
    before anything is quantized or moved. A2-14B (Wan I2V-14B) in bf16: 15.0 GiB."""
    return round(sum(m.weight.numel() * m.weight.element_size() - fp8_bytes(m.weight)
                     for _, m in base_linears(transformer) if m.weight.dtype != E4M3))


@torch.no_grad()
def quantize_base_weights(transformer: nn.Module, scaled_mm: bool = False) -> int:
    """Store the frozen linears of the blocks (base_linears) as e4m3 with per-output-channel scales, in place; call
    it after peft's add_adapter (so the LoRA matrices, trainable by then, are left alone) and before the model
    moves to the GPU (the bf16 model need not fit there). scaled_mm: CUDA bf16 forwards with fp8 matmuls (the
    caller checks scaled_mm_supported: older GPUs fail in _scaled_mm; CPU inputs take the dequantizing path).
    Returns the bytes saved.
    Idempotent: an already quantized layer is only given the scaled_mm setting."""
    saved = fp8_bytes_saved(transformer)
    ignore = []
    for name, m in base_linears(transformer):
        if m.weight.requires_grad:
            raise ValueError(f"{name}.weight is trainable: fp8 stores frozen weights (LoRA runs, after add_adapter)")
        if not isinstance(m, Fp8Linear):
            try:
                q, scale = quantize_rows(m.weight)
            except ValueError as e:
                raise ValueError(f"{name}.weight: {e}") from None
            m.__class__ = Fp8Linear
            m.weight = nn.Parameter(q, requires_grad=False)
            m.register_buffer("scale", scale.to(m.weight.device))
        m.scaled_mm = scaled_mm
        ignore += [f"{name}.weight", f"{name}.scale"]
    # DDP broadcasts every parameter and buffer from rank 0 at start; gloo has no float8 type ("Invalid scalar
    # type"), and every rank loaded and quantized the same weights anyway
    transformer._ddp_params_and_buffers_to_ignore = sorted(
        set(getattr(transformer, "_ddp_params_and_buffers_to_ignore", ())) | set(ignore))
    return saved
