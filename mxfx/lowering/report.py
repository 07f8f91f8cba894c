"""What the lowering pass did: every rewrite and every subgraph it recognised but left alone.

A compile served from Inductor's FX graph cache does not run the pass, so it adds no records.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("mxfx.lowering")

_MAX_RECORDS = 1000


@dataclass(frozen=True)
class Record:
    """One recognised subgraph.

    Attributes:
        form: ``"gated_activation"``, the MoE form (``"grouped_mm"``, ``"batched_mm"``,
            ``"dense_bmm"``, ``"gather_einsum"``), ``"gathered_bmm"`` (expert GEMMs on weights
            gathered by routing ids that no form matched), or ``"pinned"`` (an ``mxfx.moe``
            call the model made itself with ``backend="auto"``, given the oracle's backend).
        rewritten: True if the subgraph now calls an ``mxfx`` op.
        detail: the layer (MoE: E, H, I, top-k, activation, weight and activation quantization;
            activation: its parameters).
        backend: the MoE backend the oracle chose (None for activations and skips).
        reason: why the subgraph was left as written ("" when rewritten).
    """

    form: str
    rewritten: bool
    detail: str
    backend: Optional[str] = None
    reason: str = ""

    def __str__(self) -> str:
        if self.rewritten:
            via = f" -> {self.backend}" if self.backend else ""
            return f"rewrote {self.form}: {self.detail}{via}"
        return f"left {self.form}: {self.detail}: {self.reason}"


_records: list[Record] = []


def add(record: Record) -> None:
    if record.rewritten:
        log.info("%s", record)
    else:
        log.warning("%s", record)
    _records.append(record)
    del _records[:-_MAX_RECORDS]


def report() -> list[Record]:
    """The records of the compiles since the last :func:`clear` (oldest first, at most 1000)."""
    return list(_records)


def clear() -> None:
    """Forget all records."""
    _records.clear()
