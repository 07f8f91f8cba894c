"""``mxfx.quantize_``: a model's experts → MXFP4 storage, in place."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mxfx import formats
from mxfx.nn.experts import MXFP4Experts, is_experts_module, stored_bytes, to_mxfp4

logger = logging.getLogger("mxfx")


@dataclass(frozen=True)
class QuantizeReport:
    """What :func:`quantize_` converted: module names and expert-weight bytes before/after."""

    layers: tuple[str, ...]
    bytes_before: int
    bytes_after: int

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    def __str__(self) -> str:
        mib = 1 << 20
        ratio = self.bytes_after / self.bytes_before if self.bytes_before else 0.0
        return (
            f"quantized {len(self.layers)} experts modules to MXFP4: "
            f"{self.bytes_before / mib:.2f} MiB -> {self.bytes_after / mib:.2f} MiB "
            f"(saved {self.bytes_saved / mib:.2f} MiB, {ratio:.1%} of before)"
        )


def quantize_weight(w: Tensor, scale_rounding: str = "round_up") -> tuple[Tensor, Tensor]:
    """MXFP4-quantize float expert weights ``[E, N, K]`` along K → ``(uint8 [E, N, K/2],
    uint8 [E, N, K/32])``, one expert at a time so the float32 temporaries stay small."""
    e, n, k = w.shape
    packed = torch.empty(e, n, k // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(e, n, k // formats.BLOCK, dtype=torch.uint8, device=w.device)
    for i in range(e):
        packed[i], scales[i] = torch.ops.mxfx.quantize_mx(w[i], "mxfp4", scale_rounding)
    return packed, scales


@torch.no_grad()
def quantize_(model: nn.Module, scale_rounding: str = "round_up") -> QuantizeReport:
    """Convert every experts module of ``model`` to MXFP4 storage, in place.

    Experts modules are those following the protocol of :mod:`mxfx.nn.experts` (the
    transformers GptOss, Qwen3-MoE, Mixtral and MiniMax experts do). Each keeps its forward;
    its ``gate_up_proj``/``down_proj`` become dequantizing views of packed uint8 weights plus
    E8M0 scales (4.25 bits per weight), which mxfx-enabled ``torch.compile`` runs without
    dequantizing. Biases and all other parameters are untouched. Weights are quantized along
    their reduction dimension with ``scale_rounding`` ("round_up" never saturates; "floor" is
    the OCP spec's; "even" is AMD Quark's). Cast the model to its dtype before calling this:
    the weights dequantize to the dtype they had.

    Returns a :class:`QuantizeReport`; raises ``ValueError`` when the model has no experts
    module.
    """
    formats.check_scale_rounding(scale_rounding)
    found = [(name, m) for name, m in model.named_modules() if is_experts_module(m)]
    done = sum(isinstance(m, MXFP4Experts) for m in model.modules())
    if not found and done:
        raise ValueError(f"model: its {done} experts modules are MXFP4 already")
    if not found:
        raise ValueError(
            f"model: no experts module found in {type(model).__name__} (expected modules with 3-D "
            "float nn.Parameters gate_up_proj and down_proj; see mxfx.nn.experts)"
        )
    before = after = 0
    for name, module in found:
        before += stored_bytes(module)
        transposed = bool(getattr(module, "is_transposed", False))
        gate_up, down = module.gate_up_proj, module.down_proj
        if transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        for label, w in (("gate_up_proj", gate_up), ("down_proj", down)):
            if w.shape[-1] % formats.BLOCK != 0:
                raise ValueError(
                    f"model: {name}.{label} reduces over {w.shape[-1]} elements, which MXFP4 "
                    f"needs to be a multiple of {formats.BLOCK}"
                )
        w13, w13_scale = quantize_weight(gate_up, scale_rounding)
        w2, w2_scale = quantize_weight(down, scale_rounding)
        to_mxfp4(module, w13, w13_scale, w2, w2_scale)
        after += stored_bytes(module)
    report = QuantizeReport(tuple(name for name, _ in found), before, after)
    logger.info("%s", report)
    return report
