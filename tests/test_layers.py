"""mxfx's imports go one way (DESIGN.md, "Data flow"): each module imports only from its own layer
or the layers below it, read from the source, so that a back-edge fails here rather than in a
review."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "mxfx"

# Lowest first; a name is a module or a package under mxfx, the longest match decides. ops sits
# above the oracle because its eager dispatch asks the oracle (DESIGN.md, Layout); the doctor is
# the CLI's report and reads the package's version.
LAYERS = (
    ("formats", "activation", "moe_call"),
    ("kernels",),
    ("backends",),
    ("oracle",),
    ("ops",),
    ("nn", "lowering"),
    ("__init__", "__main__", "demo", "bench", "oracle.doctor"),
)


def layer(module: str) -> int:
    """The layer of ``module`` (dotted, below ``mxfx``; ``"__init__"`` for the package itself)."""
    best, found = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), i
    if found is None:
        raise KeyError(f"mxfx.{module} is in no layer of LAYERS")
    return found


def _is_module(name: str) -> bool:
    path = ROOT.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or path.is_dir()


def imported(tree: ast.AST) -> set[str]:
    """The mxfx modules a module's source imports (anywhere in it), dotted below ``mxfx``. mxfx
    imports absolutely, so a relative import is an error here."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise ValueError(f"line {node.lineno}: a relative import; mxfx imports absolutely")
            # ``from m import y``: y where it is a module of its own, else m.
            names = [f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}") else node.module
                     for a in node.names]
        else:
            continue
        out |= {"__init__" if n == "mxfx" else n[len("mxfx."):] for n in names if n.split(".")[0] == "mxfx"}
    return out


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 1 else rel.parts
        out.append((".".join(parts), path))
    return out


@pytest.mark.parametrize("module,path", modules(), ids=[m for m, _ in modules()])
def test_imports_go_down_the_layers(module, path):
    own = layer(module)
    upward = sorted(f"mxfx.{m}" for m in imported(ast.parse(path.read_text())) if layer(m) > own)
    assert not upward, f"mxfx.{module} (layer {own}) imports from a higher layer: {upward}"


def test_the_check_sees_a_back_edge():
    tree = ast.parse("from mxfx.backends.base import Backend\nfrom mxfx import ops\n")
    assert {m: layer(m) for m in imported(tree)} == {"backends.base": 2, "ops": 4}
    assert layer("kernels.moe") == 1 and layer("oracle.doctor") == 6 and layer("oracle.selector") == 3
