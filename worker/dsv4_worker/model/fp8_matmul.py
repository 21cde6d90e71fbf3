"""A scaled FP8 matmul for block-FP8 linears on CUDA devices that have one: the activations are
quantized as DeepSeek's reference inference code does (`act_quant`: e4m3 with one power-of-two
scale per token per 128 channels), the weight stays as stored (e4m3 with its 128x128 block
scales), and torch's scaled matmul (blockwise 1x128 x 128x128 recipes) multiplies them.

Chosen once per device by `probe`: every known way of calling torch's scaled matmul is tried on
a small product and compared with dequantize-then-matmul of the same quantized operands; the
first that runs and agrees is used, else None (the caller dequantizes; the reason is logged
and kept in `probe_report`). Side effects: the probe's small CUDA work, once per device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv4_worker.model.stored import FP8Block

log = logging.getLogger(__name__)

BLOCK = 128
FP8_MAX = 448.0
_PROBE_TOLERANCE = 2e-2  # relative max error: bf16 output of fp32-accumulated products

Call = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # (a, b, scale_a, scale_b) -> out
_chosen: dict[torch.device, Call | None] = {}
probe_report: dict[str, str] = {}


def act_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] (K a multiple of 128) -> (e4m3 [M, K], float32 scales [M, K/128]): the scale of
    each 128 channels of a token is the smallest power of two with amax / scale <= 448."""
    m, k = x.shape
    blocks = x.float().view(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, k), scale


def _v2(a: Tensor, b: Tensor, sa: Tensor, sb: Tensor) -> Tensor:
    st = F.ScalingType
    return F.scaled_mm(a, b, sa, st.BlockWise1x128, sb, st.BlockWise128x128)


def _v1(a: Tensor, b: Tensor, sa: Tensor, sb: Tensor) -> Tensor:
    return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)


def _outer(t: Tensor) -> Tensor:
    """The same values with the first axis contiguous (the 'outer-dim-major' scale layout)."""
    return t.t().contiguous().t()


def _variants() -> list[tuple[str, Call]]:
    out: list[tuple[str, Call]] = []
    for name, fn in (("F.scaled_mm", _v2), ("torch._scaled_mm", _v1)):
        if name == "F.scaled_mm" and not hasattr(F, "scaled_mm"):
            continue
        for a_name, a_layout in (("rows", _same), ("outer", _outer)):
            for b_name, b_layout in (("view", _same), ("contiguous", _contiguous)):
                out.append(
                    (f"{name} scale_a={a_name} scale_b={b_name}", _bind(fn, a_layout, b_layout))
                )
    return out


def _same(t: Tensor) -> Tensor:
    return t


def _contiguous(t: Tensor) -> Tensor:
    return t.contiguous()


def _bind(
    fn: Call, a_layout: Callable[[Tensor], Tensor], b_layout: Callable[[Tensor], Tensor]
) -> Call:
    def call(a: Tensor, b: Tensor, sa: Tensor, sb: Tensor) -> Tensor:
        return fn(a, b, a_layout(sa), b_layout(sb))

    return call


def _weight_scales(w: FP8Block) -> Tensor:
    """[out/128, in/128] block scales -> float32 [in/128, out/128] (a transposed view)."""
    return w.scale.to(torch.float32).t()


def _reference(q: Tensor, sa: Tensor, w: FP8Block) -> Tensor:
    m, k = q.shape
    x = (q.float().view(m, k // BLOCK, BLOCK) * sa[..., None]).view(m, k)
    weight = w.dequantize_into(torch.empty(w.shape, dtype=torch.float32, device=q.device))
    return x @ weight.t()


def probe(device: torch.device) -> Call | None:
    """The scaled matmul this device runs correctly, or None (remembered per device)."""
    if device in _chosen:
        return _chosen[device]
    chosen: Call | None = None
    reason = "not a CUDA device"
    if device.type == "cuda":
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(64, 256, device=device, generator=gen, dtype=torch.bfloat16)
        values = torch.randn(384, 256, device=device, generator=gen).to(torch.float8_e4m3fn)
        exps = torch.randint(-12, -4, (3, 2), device=device, generator=gen).float()
        scale = (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
        w = FP8Block(values, scale, (BLOCK, BLOCK))
        # Decode steps multiply one token, prefill chunks many: every size must work.
        quantized = [act_quant(x[:n]) for n in (1, 5, 64)]
        wants = [_reference(q, sa, w) for q, sa in quantized]
        reasons: list[str] = []
        for name, call in _variants():
            try:
                err = 0.0
                for (q, sa), want in zip(quantized, wants, strict=True):
                    got = call(q, w.values.t(), sa, _weight_scales(w)).float()
                    err = max(err, ((got - want).abs().max() / want.abs().max()).item())
            except Exception as exc:  # a recipe this torch or device does not have
                reasons.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                continue
            if err <= _PROBE_TOLERANCE:
                chosen, reason = call, f"{name} (probe error {err:.2e})"
                break
            reasons.append(f"{name}: disagrees with dequantize-then-matmul ({err:.2e})")
        if chosen is None:
            reason = "; ".join(reasons) or "no scaled matmul in this torch"
    _chosen[device] = chosen
    probe_report[str(device)] = ("scaled FP8 matmul: " if chosen else "dequantize: ") + reason
    log.info("block-FP8 linears on %s: %s", device, probe_report[str(device)])
    return chosen


def scaled_linear(x: Tensor, w: FP8Block) -> Tensor | None:
    """x [..., in] @ w.T through the device's scaled FP8 matmul (bfloat16 out), or None when
    it does not apply (not CUDA bfloat16, dimensions not multiples of 128, no working recipe)."""
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return None
    rows, cols = w.shape
    if w.block != (BLOCK, BLOCK) or w.row_offset or rows % BLOCK or cols % BLOCK:
        return None
    call = probe(x.device)
    if call is None:
        return None
    flat = x.reshape(-1, cols)
    q, sa = act_quant(flat)
    out = call(q, w.values.t(), sa, _weight_scales(w))
    return out.view(*x.shape[:-1], rows)
