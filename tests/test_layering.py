"""The package's dependency direction: each package imports only from the packages above it.

errors, rng → ops → io → quant → models → lora → data → training → export → api → cli.
A module or package missing from LAYERS fails the test, so a new one is placed on purpose;
ggtorch/ holds at most five modules of its own (the rest lives in packages that name their job).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ggtorch"

LAYERS: dict[str, int] = {
    "errors": 0,
    "rng": 0,
    "ops": 1,
    "io": 2,
    "quant": 3,
    "models": 4,
    "lora": 5,
    "data": 6,
    "training": 7,
    "export": 8,
    "api": 9,
    "cli": 10,
    "__main__": 11,
    "__init__": 11,
}

TOP_LEVEL_MODULES = 5


def _unit(path: Path) -> str:
    """The layer unit a file belongs to: its top-level module or subpackage under ggtorch/."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_units(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(PACKAGE)
    units: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "ggtorch" and len(parts) > 1:
                    units.add(parts[1])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] != "ggtorch":
                    continue
                rest = parts[1:]
            else:
                # relative import: resolve against the file's package inside ggtorch/
                base = list(rel.parts[:-1])[: len(rel.parts) - node.level]
                rest = base + (node.module.split(".") if node.module else [])
            if rest:
                units.add(rest[0])
            else:
                units.update(alias.name for alias in node.names)
    return units


def test_every_module_has_a_layer() -> None:
    units = {_unit(p) for p in PACKAGE.rglob("*.py")}
    missing = sorted(units - LAYERS.keys())
    assert not missing, f"place these modules in LAYERS: {missing}"


def test_few_modules_at_the_top() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_MODULES, f"ggtorch/ holds {len(top)} modules ({top}); move some into a package"


def test_layers_are_whole_numbers() -> None:
    assert all(isinstance(v, int) for v in LAYERS.values())


def test_imports_point_down() -> None:
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = _unit(path)
        for dep in _imported_units(path):
            if dep == unit:
                continue
            if dep not in LAYERS or LAYERS[dep] >= LAYERS[unit]:
                violations.append(f"{path.relative_to(PACKAGE.parent)} imports ggtorch.{dep}")
    assert not violations, "imports against the layer order:\n" + "\n".join(violations)


def test_llama_cpp_is_never_a_runtime_dependency() -> None:
    offenders = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
                 if "llama_cpp" in _top_level_imports(p)]
    assert not offenders, f"ggtorch must not import llama_cpp (test-only reference): {offenders}"


def _top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


DEVICES = {"cpu", "cuda", "mps", "xpu", "meta"}
POLICY = PACKAGE / "ops" / "policy.py"


def test_device_choices_live_in_the_policy_only() -> None:
    """No module outside ops/policy.py keeps a module-level on/off switch (a bool constant) or a tuple of device
    names, or compares a device against one: kernel and size choices per device are the policy's (issue 59; the
    tree before it had e.g. native.py's switch and optim.py's FUSED_DEVICES = ("cpu", "cuda"))."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path == POLICY:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:  # module level
            value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, bool):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: a module-level switch")
            if _device_names(value):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: a module-level device tuple")
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
                if any(_device_names(right) for right in node.comparators):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: a device tuple")
    assert not found, found


def _device_names(node: ast.AST | None) -> set[str]:
    """The device names (cpu, cuda, ...) a tuple, list or set literal holds."""
    return {e.value for e in getattr(node, "elts", []) if isinstance(e, ast.Constant)} & DEVICES
