"""Loading MXFP4 expert weights from checkpoints without dequantizing them.

Two checkpoint conventions are understood, per experts module at ``{prefix}``:

**gpt-oss** (OpenAI's release; what transformers' MXFP4 integration reads)::

    {prefix}.gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]   gate/up interleaved along 2I
    {prefix}.gate_up_proj_scales  uint8 [E, 2I, H/32]       E8M0, bias 127
    {prefix}.gate_up_proj_bias    float [E, 2I]
    {prefix}.down_proj_blocks     uint8 [E, H, I/32, 16]
    {prefix}.down_proj_scales     uint8 [E, H, I/32]
    {prefix}.down_proj_bias       float [E, H]

Element 2i of a block is the low nibble of its byte, 2i+1 the high nibble, so the blocks
reshaped to ``[E, N, K/2]`` are mxfx's canonical packed layout as they are.

**AMD Quark** (``quant_method: "quark"``, OCP MX export): one Linear per expert and projection::

    {prefix}.{e}.gate_proj.weight        uint8 [I, H/2]   (also w1 / w3 / w2, the Mixtral names)
    {prefix}.{e}.gate_proj.weight_scale  uint8 [I, H/32]
    {prefix}.{e}.up_proj.weight / .weight_scale,  {prefix}.{e}.down_proj.weight / .weight_scale
    optional {prefix}.{e}.{proj}.bias

gate and up are concatenated into halves (``w13 = [gate; up]``). The activation scheme comes
from ``quantization_config`` (``layer_quant_config`` pattern → ``global_quant_config``;
``exclude``): ``input_tensors`` fp4 per_group 32 → activation_quant "mxfp4" (W4A4), fp8_e4m3
per_group 32 → "mxfp8" (W4A8), none → "none" (W4A16). Any other activation scheme is refused
with an error rather than run with activations the checkpoint was not calibrated for.
"""
from __future__ import annotations

import contextlib
import fnmatch
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import Tensor, nn

from mxfx import formats
from mxfx.moe_call import MoEWeights
from mxfx.nn.experts import is_experts_module, to_mxfp4

_QUARK_PROJ_NAMES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
# The Quark scale rounding modes that are the same computation as an mxfx one.
_QUARK_SCALE_MODES = {"even": "even", "floor": "floor"}


@dataclass(frozen=True)
class LoadedLayer:
    """One experts module :func:`load_mxfp4_checkpoint` built: its name, the checkpoint
    convention (``"gpt-oss"`` or ``"quark"``) and its activation quantization."""

    name: str
    convention: str
    activation_quant: str


def gpt_oss_experts(tensors: Mapping[str, Tensor], prefix: str) -> MoEWeights:
    """The canonical MXFP4 weights of the gpt-oss experts module at ``prefix``.

    ``tensors`` maps checkpoint keys to tensors (a dict, or a lazy mapping over safetensors
    files). Biases are None when absent. Raises ``KeyError``/``ValueError`` naming the key.
    """
    out = {}
    for proj, canon in (("gate_up_proj", "w13"), ("down_proj", "w2")):
        blocks = _get(tensors, f"{prefix}.{proj}_blocks")
        scales = _get(tensors, f"{prefix}.{proj}_scales")
        if blocks.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != formats.BLOCK // 2:
            raise ValueError(
                f"{prefix}.{proj}_blocks: got {blocks.dtype} {tuple(blocks.shape)}, expected "
                f"uint8 [E, N, K/32, {formats.BLOCK // 2}]"
            )
        if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise ValueError(
                f"{prefix}.{proj}_scales: got {scales.dtype} {tuple(scales.shape)}, expected "
                f"uint8 {tuple(blocks.shape[:-1])}"
            )
        out[canon] = blocks.reshape(*blocks.shape[:2], -1)
        out[f"{canon}_scale"] = scales
        out[f"{canon}_bias"] = tensors.get(f"{prefix}.{proj}_bias")
    return MoEWeights(**out)


def quark_experts(tensors: Mapping[str, Tensor], prefix: str, num_experts: int) -> MoEWeights:
    """The canonical MXFP4 weights of the Quark-exported experts ``prefix.{0..E-1}``
    (gate and up concatenated as halves). Raises ``KeyError``/``ValueError`` naming the key."""
    projs = {}
    for role in ("gate", "up", "down"):
        name = _quark_proj_name(tensors, prefix, role)
        ws, ss, bs = [], [], []
        for e in range(num_experts):
            key = f"{prefix}.{e}.{name}"
            w, s = _get(tensors, f"{key}.weight"), _get(tensors, f"{key}.weight_scale")
            if w.dtype != torch.uint8 or s.dtype != torch.uint8 or w.dim() != 2:
                raise ValueError(
                    f"{key}.weight: got {w.dtype} {tuple(w.shape)} with scale {s.dtype}, "
                    "expected packed MXFP4 (uint8 [N, K/2]) with uint8 E8M0 scales"
                )
            if tuple(s.shape) != (w.shape[0], w.shape[1] * 2 // formats.BLOCK):
                raise ValueError(
                    f"{key}.weight_scale: got shape {tuple(s.shape)}, expected "
                    f"{(w.shape[0], w.shape[1] * 2 // formats.BLOCK)}"
                )
            ws.append(w)
            ss.append(s)
            bs.append(tensors.get(f"{key}.bias"))
        if any(b is None for b in bs) and not all(b is None for b in bs):
            raise ValueError(f"{prefix}.*.{name}.bias: present for some experts and not others")
        bias = None if bs[0] is None else torch.stack(bs)
        projs[role] = (torch.stack(ws), torch.stack(ss), bias)
    (gw, gs, gb), (uw, us, ub), (dw, ds, db) = projs["gate"], projs["up"], projs["down"]
    if gw.shape != uw.shape:
        raise ValueError(f"{prefix}: gate {tuple(gw.shape)} and up {tuple(uw.shape)} projections differ")
    b13 = None if gb is None or ub is None else torch.cat((gb, ub), dim=1)
    return MoEWeights(
        torch.cat((gw, uw), dim=1), torch.cat((gs, us), dim=1), b13, dw, ds, db
    )


def _quark_proj_name(tensors: Mapping[str, Tensor], prefix: str, role: str) -> str:
    for name in _QUARK_PROJ_NAMES[role]:
        if f"{prefix}.0.{name}.weight" in tensors:
            return name
    raise KeyError(
        f"{prefix}.0.{{{','.join(_QUARK_PROJ_NAMES[role])}}}.weight: no {role} projection of "
        "expert 0 in the checkpoint"
    )


def quark_activation_quant(quantization_config: Mapping[str, Any], layer_name: str) -> tuple[str, str]:
    """``(activation_quant, scale_rounding)`` of the Quark-quantized Linear ``layer_name``.

    Follows Quark's lookup: ``exclude`` → unquantized; the first matching
    ``layer_quant_config`` pattern; else ``global_quant_config``. Raises ``ValueError`` for a
    weight scheme other than MXFP4 or an activation scheme mxfx does not execute.
    """
    if quantization_config.get("quant_method", "quark") != "quark":
        raise ValueError(
            f"quantization_config: quant_method is {quantization_config.get('quant_method')!r}, "
            "expected 'quark'"
        )
    if any(_matches(layer_name, p) for p in quantization_config.get("exclude") or ()):
        return "none", "even"
    scheme = quantization_config.get("global_quant_config") or {}
    for pattern, cfg in (quantization_config.get("layer_quant_config") or {}).items():
        if _matches(layer_name, pattern):
            scheme = cfg
            break
    weight = scheme.get("weight") or {}
    if not (_is_mx_group(weight) and weight.get("dtype") == "fp4"):
        raise ValueError(
            f"quantization_config: weight scheme of {layer_name} is {dict(weight)}, expected "
            "MXFP4 (dtype fp4, qscheme per_group, group_size 32, scale_format e8m0)"
        )
    act = scheme.get("input_tensors")
    if not act:
        return "none", "even"
    fmt = {"fp4": "mxfp4", "fp8_e4m3": "mxfp8"}.get(act.get("dtype"))
    mode = _QUARK_SCALE_MODES.get(act.get("scale_calculation_mode", "even"))
    if fmt is None or not _is_mx_group(act) or act.get("is_dynamic", True) is False or mode is None:
        raise ValueError(
            f"quantization_config: input_tensors scheme of {layer_name} is {dict(act)}; mxfx "
            "executes only dynamic OCP MX activations (dtype fp4 or fp8_e4m3, qscheme per_group, "
            f"group_size 32, scale_format e8m0, scale_calculation_mode in {sorted(_QUARK_SCALE_MODES)}) "
            "and will not run this checkpoint with other activations"
        )
    return fmt, mode


def _is_mx_group(scheme: Mapping[str, Any]) -> bool:
    return (
        scheme.get("qscheme") == "per_group"
        and scheme.get("group_size") == formats.BLOCK
        and scheme.get("scale_format", "e8m0") == "e8m0"
    )


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatch(name, pattern) if "*" in pattern else name == pattern


def _get(tensors: Mapping[str, Tensor], key: str) -> Tensor:
    if key not in tensors:
        raise KeyError(f"{key}: not in the checkpoint")
    return tensors[key]


class SafetensorsDir(Mapping[str, Tensor]):
    """A read-only mapping over the tensors of one ``.safetensors`` file or of every such file
    in a directory; tensors are read on access (on CPU)."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        path = os.fspath(path)
        files = (
            sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
            if os.path.isdir(path)
            else [path]
        )
        if not files:
            raise ValueError(f"path: no .safetensors files in {path}")
        self._handles = [safe_open(f, framework="pt", device="cpu") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}

    def __getitem__(self, key: str) -> Tensor:
        return self._where[key].get_tensor(key)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Modules built inside this block get their parameters on the meta device (no memory) and
    their buffers as usual, so that :func:`load_mxfp4_checkpoint` can fill a model whose float
    experts would not fit::

        with mxfx.nn.empty_parameters():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        load_mxfp4_checkpoint(model, path, device="cuda")
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@torch.no_grad()
def load_mxfp4_checkpoint(
    model: nn.Module,
    path: str | os.PathLike | Mapping[str, Tensor],
    quantization_config: Optional[Mapping[str, Any]] = None,
    strict: bool = True,
    device: torch.device | str | None = None,
) -> list[LoadedLayer]:
    """Load a gpt-oss-style or Quark-style MXFP4 checkpoint into ``model`` (e.g. a transformers
    model built from the checkpoint's config), keeping the experts in MXFP4.

    ``path``: a ``.safetensors`` file, a directory of them (its ``config.json`` supplies
    ``quantization_config`` when not given), or a mapping of tensors. Every experts module whose
    weights the checkpoint holds in either convention becomes MXFP4 storage (see
    :mod:`mxfx.nn.experts`); a Quark layer's activation scheme becomes its ``activation_quant``.
    All other tensors load as ``load_state_dict`` would, cast to the model's dtypes. The model
    may have been built under :func:`empty_parameters` (parameters on the meta device).
    ``device``: where the model ends up (default: where its parameters are, else the CPU).
    With ``strict``, keys of the checkpoint the model does not take, or model tensors the
    checkpoint lacks, raise ``ValueError``.
    """
    tensors = path if isinstance(path, Mapping) else SafetensorsDir(path)
    if quantization_config is None and not isinstance(path, Mapping) and os.path.isdir(path):
        config_file = os.path.join(path, "config.json")
        if os.path.exists(config_file):
            with open(config_file) as f:
                quantization_config = json.load(f).get("quantization_config")
    device = torch.device(device) if device is not None else _model_device(model)
    used: set[str] = set()
    loaded = []
    for name, module in [(n, m) for n, m in model.named_modules() if is_experts_module(m)]:
        e = module.gate_up_proj.shape[0]
        if f"{name}.gate_up_proj_blocks" in tensors:
            weights, convention, aq = gpt_oss_experts(tensors, name), "gpt-oss", ("none", "even")
            used.update(k for k in tensors if k.startswith((f"{name}.gate_up_proj_", f"{name}.down_proj_")))
        elif any(f"{name}.0.{n}.weight" in tensors for n in _QUARK_PROJ_NAMES["gate"]):
            weights, convention = quark_experts(tensors, name, e), "quark"
            if quantization_config is None:
                raise ValueError(
                    f"quantization_config: {name} holds Quark MXFP4 experts but no "
                    "quantization_config was given or found in config.json"
                )
            gate = _quark_proj_name(tensors, name, "gate")
            aq = quark_activation_quant(quantization_config, f"{name}.0.{gate}")
            used.update(k for k in tensors if k.startswith(f"{name}."))
        else:
            continue
        _load_biases(module, name, weights, device)
        packed = (weights.w13, weights.w13_scale, weights.w2, weights.w2_scale)
        to_mxfp4(
            module, *(t.to(device) for t in packed),
            activation_quant=aq[0], activation_scale_rounding=aq[1],
        )
        loaded.append(LoadedLayer(name, convention, aq[0]))
    rest = {k: tensors[k] for k in tensors if k not in used}
    _load_rest(model, rest, tuple(f"{layer.name}." for layer in loaded), strict, device)
    return loaded


def _model_device(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def _load_biases(module: nn.Module, name: str, weights: MoEWeights, device: torch.device) -> None:
    for attr, value in (("gate_up_proj_bias", weights.w13_bias), ("down_proj_bias", weights.w2_bias)):
        param = getattr(module, attr, None)
        if (param is None) != (value is None):
            have = "has" if param is not None else "has no"
            given = "holds" if value is not None else "lacks"
            raise ValueError(f"{name}.{attr}: the model {have} this bias but the checkpoint {given} it")
        if param is None:
            continue
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(
                f"{name}.{attr}: checkpoint shape {tuple(value.shape)}, model shape {tuple(param.shape)}"
            )
        bias = nn.Parameter(value.to(device=device, dtype=param.dtype), requires_grad=param.requires_grad)
        module.register_parameter(attr, bias)


def _load_rest(
    model: nn.Module, rest: dict[str, Tensor], done: tuple[str, ...], strict: bool, device: torch.device
) -> None:
    """``load_state_dict`` of ``rest`` onto ``device``; tensors under the prefixes ``done`` are
    loaded already."""
    state = model.state_dict(keep_vars=True)
    rest = {
        k: v.to(device=device, dtype=state[k].dtype)
        if k in state and v.is_floating_point() and state[k].is_floating_point()
        else v
        for k, v in rest.items()
    }
    # Meta tensors cannot be copied into; they are replaced, which breaks weight tying, so
    # transformers models retie afterwards.
    on_meta = any(t.device.type == "meta" for t in state.values())
    result = model.load_state_dict(rest, strict=False, assign=on_meta)
    if on_meta and hasattr(model, "tie_weights"):
        model.tie_weights()
    still_meta = [k for k, t in model.state_dict().items() if t.device.type == "meta"]
    if still_meta:
        raise ValueError(f"path: the checkpoint does not hold {still_meta[:8]}, which are on the meta device")
    model.to(device)
    state = model.state_dict()
    # A tied tensor (say lm_head.weight = embed_tokens.weight) is loaded through its twin.
    loaded = {state[k].data_ptr() for k in rest if k in state}
    unexpected = list(result.unexpected_keys)
    missing = [
        k for k in result.missing_keys if not k.startswith(done) and state[k].data_ptr() not in loaded
    ]
    if strict and (unexpected or missing):
        raise ValueError(
            f"path: checkpoint and model differ; keys the model does not take: {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}; model tensors not in the checkpoint: "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
