"""The platform a MoE layer runs on: device kind, architecture, optional packages."""
from __future__ import annotations

import functools
import importlib.util
import platform as _host
import re
from dataclasses import dataclass
from typing import Optional, Union

import torch

KINDS = ("cuda", "rocm", "xpu", "cpu")
OPTIONAL_PACKAGES = ("triton", "aiter")
# AMD architectures with MX (block-scaled FP4/FP8) matrix instructions.
_ROCM_NATIVE_MX = frozenset({"gfx950"})


@dataclass(frozen=True)
class Platform:
    """Where a layer runs. Construct any platform to simulate it; :meth:`current` detects this one.

    Args:
        kind: ``"cuda"``, ``"rocm"``, ``"xpu"`` or ``"cpu"``.
        arch: ``"sm90"``, ``"sm100"``, ``"gfx942"``, ``"gfx950"``, ...; the machine name on CPU.
        packages: the optional packages that import here (``"triton"``, ``"aiter"``).
    """

    kind: str
    arch: str = ""
    packages: frozenset = frozenset()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: got {self.kind!r}, expected one of {list(KINDS)}")
        if not isinstance(self.arch, str):
            raise TypeError(f"arch: got {self.arch!r}, expected a string such as 'sm90' or 'gfx950'")
        if isinstance(self.packages, str) or not all(isinstance(p, str) for p in self.packages):
            raise TypeError(f"packages: got {self.packages!r}, expected a set of package names")
        object.__setattr__(self, "packages", frozenset(self.packages))

    @property
    def native_mx(self) -> bool:
        """Whether the GPU has MX matrix instructions (NVIDIA sm100 and later, AMD gfx950)."""
        if self.kind == "cuda":
            m = re.fullmatch(r"sm(\d+)[a-z]?", self.arch)
            return m is not None and int(m.group(1)) >= 100
        return self.kind == "rocm" and self.arch in _ROCM_NATIVE_MX

    def __str__(self) -> str:
        pkgs = ", ".join(sorted(self.packages)) or "none"
        mx = "native MX" if self.native_mx else "no native MX"
        return f"{self.kind} {self.arch or '?'} ({mx}; optional packages: {pkgs})"

    @staticmethod
    def current(device: Optional[Union[str, torch.device]] = None) -> "Platform":
        """This machine's platform for ``device`` (None: the default accelerator, else the CPU).

        Detected once per device and cached.
        """
        return _current(None if device is None else torch.device(device))


@functools.lru_cache(maxsize=None)
def _current(device: Optional[torch.device]) -> Platform:
    if device is None:
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        elif hasattr(torch, "xpu") and torch.xpu.is_available():
            device = torch.device("xpu", torch.xpu.current_device())
        else:
            device = torch.device("cpu")
    packages = frozenset(p for p in OPTIONAL_PACKAGES if importlib.util.find_spec(p) is not None)
    if device.type == "cpu":
        return Platform("cpu", _host.machine(), packages)
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        if torch.version.hip:
            arch = torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]
            return Platform("rocm", arch, packages)
        major, minor = torch.cuda.get_device_capability(index)
        return Platform("cuda", f"sm{major}{minor}", packages)
    if device.type == "xpu":
        index = torch.xpu.current_device() if device.index is None else device.index
        return Platform("xpu", torch.xpu.get_device_properties(index).name, packages)
    raise ValueError(f"device: got {device}, expected a cpu, cuda (NVIDIA or ROCm) or xpu device")
