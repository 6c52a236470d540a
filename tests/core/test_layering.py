"""tkcc's import layering (docs: "Package layout and layering"), checked on the source with ``ast``.

Every ``import`` in every module under ``tkcc/`` counts: at module level or inside a function,
``import x`` and ``from x import y`` (``y`` a submodule counts as that module), relative imports
resolved, and ``importlib.import_module("tkcc...")`` / ``__import__("tkcc...")`` with a literal name.
A failure lists each offending ``file:line``, what it imports and the rule it breaks.

The layers, lowest first; a unit may import its own modules and any unit of an earlier layer, never
a later layer, and never another unit of its own layer:

    base          errors, version, defaults, atomic, scratch, disk_cache (import nothing of tkcc but base)
    kernels, traffic   leaves: import nothing of tkcc but ``tkcc.errors``
    frontend
    passes        may call kernel ops; may not import runtime, agents, parallel or traffic: what a pass
                  needs from them arrives as a parameter (``Pass.context_keys``, ``PassManager(context=)``)
    parallel, science  not in the design's chain; both build on passes (parallel: the sharding pass, its
                  layouts; science: models checked through the general passes), and nothing below them
                  imports them: they sit right above passes, side by side
    codegen
    pipeline
    runtime
    agents
    serve         above agents: ``--watch`` runs the agents' drift loop beside the server
    api           ``tkcc/__init__``, compiler, compiled, cli, commands (every subcommand), backend
                  (the torch.compile entry: it runs the pipeline)
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# unit -> the modules it is made of (a name covers its submodules; "tkcc" is the package's __init__ only)
UNITS = {
    "base": ("tkcc.errors", "tkcc.version", "tkcc.defaults", "tkcc.atomic", "tkcc.scratch", "tkcc.disk_cache"),
    "kernels": ("tkcc.kernels",),
    "traffic": ("tkcc.traffic",),
    "frontend": ("tkcc.frontend",),
    "passes": ("tkcc.passes",),
    "parallel": ("tkcc.parallel",),
    "science": ("tkcc.science",),
    "codegen": ("tkcc.codegen",),
    "pipeline": ("tkcc.pipeline",),
    "runtime": ("tkcc.runtime",),
    "agents": ("tkcc.agents",),
    "serve": ("tkcc.serve",),
    "api": ("tkcc", "tkcc.compiler", "tkcc.compiled", "tkcc.cli", "tkcc.commands", "tkcc.backend"),
}
LAYERS = [["base"], ["kernels", "traffic"], ["frontend"], ["passes"], ["parallel", "science"], ["codegen"],
          ["pipeline"], ["runtime"], ["agents"], ["serve"], ["api"]]
LEAVES = {"kernels", "traffic"}  # import nothing of tkcc but errors
LEAF_MAY_IMPORT = {"tkcc.errors"}
PASSES_MAY_NOT = {"runtime", "agents", "parallel", "traffic"}

LEVEL = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def unit_of(module: str) -> str | None:
    """The unit a dotted module name belongs to (its longest listed prefix), or None."""
    best, best_len = None, -1
    for unit, names in UNITS.items():
        for name in names:
            hit = module == name if name == "tkcc" else (module == name or module.startswith(name + "."))
            if hit and len(name) > best_len:
                best, best_len = unit, len(name)
    return best


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def tkcc_modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / "tkcc").rglob("*.py"))}


def _literal_import(node: ast.Call) -> str | None:
    """The module of ``importlib.import_module("x")`` / ``__import__("x")`` with a literal name."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def imports_of(path: Path, module: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported tkcc module) for every import in the file, wherever it is."""
    tree = ast.parse(path.read_text(), str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            # `from tkcc.x import y`: y may be a submodule (then that is what is imported) or a name in x
            targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in known else src for a in node.names]
        elif isinstance(node, ast.Call):
            name = _literal_import(node)
            targets = [name] if name else []
        out += [(node.lineno, t) for t in dict.fromkeys(targets) if t == "tkcc" or t.startswith("tkcc.")]
    return out


def rule_broken(src_unit: str, target: str) -> str | None:
    """The rule an import of ``target`` from a module of ``src_unit`` breaks, or None."""
    dst_unit = unit_of(target)
    if dst_unit is None:
        return f"{target} belongs to no layer (add it to UNITS in tests/core/test_layering.py)"
    if src_unit in LEAVES:
        if dst_unit != src_unit and target not in LEAF_MAY_IMPORT:
            return f"{src_unit} is a leaf: it imports nothing of tkcc but errors"
        return None
    if src_unit == "passes" and dst_unit in PASSES_MAY_NOT:
        return ("a pass may not import runtime, agents, parallel or traffic: what it needs from them arrives "
                "as a parameter")
    if dst_unit == src_unit:
        return None
    if LEVEL[dst_unit] > LEVEL[src_unit]:
        return f"{src_unit} may not import {dst_unit}, a later layer"
    if LEVEL[dst_unit] == LEVEL[src_unit]:
        return f"{src_unit} may not import {dst_unit}: they sit side by side in one layer"
    return None


def violations(root: Path) -> list[str]:
    mods = tkcc_modules(root)
    known = set(mods)
    out = []
    for module, path in mods.items():
        src_unit = unit_of(module)
        where = path.relative_to(root)
        if src_unit is None:
            out.append(f"{where}: module {module} belongs to no layer (add it to UNITS in tests/core/test_layering.py)")
            continue
        for line, target in imports_of(path, module, known):
            why = rule_broken(src_unit, target)
            if why:
                out.append(f"{where}:{line}: imports {target}: {why}")
    return out


def test_every_unit_sits_in_one_layer():
    assert sorted(LEVEL) == sorted(UNITS) and len(LEVEL) == sum(len(layer) for layer in LAYERS)


def test_tkcc_imports_follow_the_layers():
    found = violations(ROOT)
    assert not found, f"{len(found)} import(s) break the layering (docs: Package layout and layering):\n" + \
        "\n".join(found)


def test_the_torch_compile_backend_entry_is_in_the_api_layer():
    """The backend runs the build pipeline, so the entry point pyproject registers names an API module."""
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    module = meta["project"]["entry-points"]["torch_dynamo_backends"]["tkcc"].partition(":")[0]
    assert unit_of(module) == "api", module
    assert not (ROOT / "tkcc" / "frontend" / "backend.py").exists()


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_the_check_names_each_broken_rule(tmp_path):
    """A small tree with one import of each kind that breaks a rule (and some that do not): each is named with
    its file:line and rule, wherever the import sits and however it is spelled."""
    pkgs = ["tkcc", "tkcc/kernels", "tkcc/passes", "tkcc/codegen", "tkcc/frontend", "tkcc/runtime",
            "tkcc/parallel", "tkcc/traffic", "tkcc/agents", "tkcc/serve"]
    files = {f"{p}/__init__.py": "" for p in pkgs}
    files.update({
        "tkcc/errors.py": "",
        "tkcc/compiler.py": "",
        "tkcc/kernels/ops.py": ("from tkcc.errors import TkccError\n\n\n"
                                "def f():\n    from tkcc.codegen.targets import kernel\n"),
        "tkcc/kernels/gemv.py": "from . import ops\nfrom ..frontend import weight_packing\n",
        "tkcc/passes/sharding.py": "import tkcc.kernels.ops\nfrom tkcc.parallel import layout\n",
        "tkcc/passes/moe.py": "def order():\n    from tkcc.traffic.routing import Routing\n",
        "tkcc/passes/fusion.py": "import importlib\nimportlib.import_module('tkcc.codegen.rowwise')\n",
        "tkcc/codegen/artifact.py": "from tkcc.passes import sharding\n\n\ndef build():\n    import tkcc\n",
        "tkcc/runtime/cli.py": "from tkcc import compiler\nfrom tkcc.agents import store\n",
        "tkcc/agents/store.py": "from tkcc.serve import app\n",
        "tkcc/serve/app.py": "from tkcc.agents import store\n",
        "tkcc/frontend/weight_packing.py": "",
        "tkcc/parallel/layout.py": "",
        "tkcc/newpkg/x.py": "from tkcc.errors import TkccError\n",
    })
    files["tkcc/frontend/backend.py"] = "from tkcc.backend import make_backend\n"
    found = violations(_tree(tmp_path, files))
    text = "\n".join(found)
    expected = [
        "tkcc/kernels/ops.py:5: imports tkcc.codegen.targets: kernels is a leaf",
        "tkcc/kernels/gemv.py:2: imports tkcc.frontend.weight_packing: kernels is a leaf",
        "tkcc/passes/sharding.py:2: imports tkcc.parallel.layout: a pass may not import",
        "tkcc/passes/moe.py:2: imports tkcc.traffic.routing: a pass may not import",
        "tkcc/passes/fusion.py:2: imports tkcc.codegen.rowwise: passes may not import codegen, a later layer",
        "tkcc/codegen/artifact.py:5: imports tkcc: codegen may not import api, a later layer",
        "tkcc/runtime/cli.py:1: imports tkcc.compiler: runtime may not import api, a later layer",
        "tkcc/runtime/cli.py:2: imports tkcc.agents.store: runtime may not import agents, a later layer",
        "tkcc/agents/store.py:1: imports tkcc.serve.app: agents may not import serve, a later layer",
        "tkcc/frontend/backend.py:1: imports tkcc.backend: frontend may not import api, a later layer",
        "tkcc/newpkg/x.py: module tkcc.newpkg.x belongs to no layer",
    ]
    for e in expected:
        assert any(f.startswith(e) for f in found), f"not reported: {e}\ngot:\n{text}"
    assert len(found) == len(expected), text  # the allowed imports (kernels->errors, passes->kernels, ...) pass
    for allowed in ("tkcc/passes/sharding.py:1", "tkcc/codegen/artifact.py:1", "tkcc/serve/app.py",
                    "tkcc/kernels/gemv.py:1"):
        assert allowed not in text


def test_relative_imports_resolve_against_the_package(tmp_path):
    files = {"tkcc/__init__.py": "", "tkcc/errors.py": "", "tkcc/passes/__init__.py": "from .lower import x\n",
             "tkcc/passes/lower/__init__.py": "from ...codegen import emit\nfrom .. import base\n",
             "tkcc/passes/base.py": "", "tkcc/codegen/__init__.py": "", "tkcc/codegen/emit.py": ""}
    mods = tkcc_modules(_tree(tmp_path, files))
    got = imports_of(mods["tkcc.passes.lower"], "tkcc.passes.lower", set(mods))
    assert got == [(1, "tkcc.codegen.emit"), (2, "tkcc.passes.base")]
    assert imports_of(mods["tkcc.passes"], "tkcc.passes", set(mods)) == [(1, "tkcc.passes.lower")]


if __name__ == "__main__":  # python tests/core/test_layering.py [ROOT]: the list, without pytest
    found = violations(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    print("\n".join(found) or "layering ok")
    sys.exit(1 if found else 0)
