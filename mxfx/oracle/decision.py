"""What the oracle decided for one layer, and the error when no backend can run it."""
from __future__ import annotations

from dataclasses import dataclass

from mxfx.oracle.config import MoEConfig
from mxfx.oracle.platform import Platform
from mxfx.oracle.quant import ActivationQuantKey


@dataclass(frozen=True)
class Decision:
    """The backend chosen for ``config`` on ``platform``, and why the others were not.

    Attributes:
        backend: the chosen backend's name.
        requested: ``"auto"`` or the backend name that was asked for.
        source: where the request came from (``"auto"``, ``"the backend argument"``,
            ``"mxfx.configure(moe_backend=...)"`` or ``"MXFX_MOE_BACKEND"``).
        activation_quant: the activation quantization the backend executes. It differs from
            ``config.activation_quant`` only when the user allowed higher-precision activations.
        considered: every backend looked at, in priority order.
        rejected: ``(name, reason)`` for each considered backend that cannot run the layer.
        note: the chosen backend's declared note (e.g. "not verified by mxfx"), or "".
    """

    backend: str
    config: MoEConfig
    platform: Platform
    requested: str
    source: str
    activation_quant: ActivationQuantKey
    considered: tuple
    rejected: list
    note: str = ""

    @property
    def higher_precision(self) -> bool:
        """True when the layer runs with higher-precision activations than its checkpoint."""
        return self.activation_quant != self.config.activation_quant

    def summary(self) -> str:
        """One line: the layer, the platform and the chosen backend."""
        how = "auto" if self.requested == "auto" else f"requested by {self.source}"
        line = f"MoE {self.config} on {self.platform.kind} {self.platform.arch}: {self.backend} ({how})"
        if self.higher_precision:
            line += (
                f", activations run as {self.activation_quant}, not the checkpoint's "
                f"{self.config.activation_quant} (allow_higher_precision_activations=True)"
            )
        return line

    def __str__(self) -> str:
        reasons = dict(self.rejected)
        width = max(len(n) for n in self.considered)
        rows = [self.summary(), f"platform: {self.platform}"]
        for name in self.considered:
            if name == self.backend:
                status = "chosen"
                if self.higher_precision:
                    status += f" (runs activation_quant={self.activation_quant}: higher precision)"
                if self.note:
                    status += f"; {self.note}"
            elif name in reasons:
                status = f"rejected: {reasons[name]}"
            else:
                status = "eligible, lower priority"
            rows.append(f"  {name:<{width}}  {status}")
        return "\n".join(rows)


class NoBackendError(RuntimeError):
    """No backend can run the layer (or the requested one cannot). ``rejected`` lists every
    candidate and its reason."""

    def __init__(self, config: MoEConfig, platform: Platform, requested: str, source: str, rejected: list):
        self.config, self.platform, self.rejected = config, platform, rejected
        if requested == "auto":
            head = f"no MoE backend can run {config} on {platform}:"
        else:
            head = f"backend {requested!r} (requested by {source}) cannot run {config} on {platform}:"
        super().__init__("\n".join([head, *(f"  {n}: {r}" for n, r in rejected)]))
