"""The package's dependency direction: each module imports only from layers below it.

errors → gguf_io → quant → models → (lora, inference) → adapters → (data, optim) → checkpoint →
(trainer | export) → api → cli. A module missing from LAYERS fails the test, so a new module
has to be placed in the order on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ggtorch"

LAYERS: dict[str, float] = {
    "errors": 0,
    "allocator": 0.5,  # only the CLI entry uses it, before anything heavy
    "mt19937": 0,
    "matmul": 0,
    "gguf_io": 1,
    "quant": 2,
    "models": 3,
    "lora": 4,
    "loss": 4.5,  # the fused output loss knows LoRALinear
    "inference": 4,
    "adapters": 5,
    "scratch": 5,
    "data": 6,
    "optim": 6,
    "checkpoint": 7,
    "distributed": 7,
    "finetune_config": 7,
    "train_config": 7.5,  # extends finetune_config, below trainer
    "train_log": 7,
    "trainer": 8,
    "export": 8,
    "api": 9,
    "demo": 9.5,  # runs the API end to end
    "cli_finetune": 10,
    "cli_peft": 10,
    "cli_export": 10,
    "cli_demo": 10,
    "cli_train": 10.5,  # reuses cli_finetune's option table
    "cli": 11,
    "__main__": 12,
    "__init__": 12,
}


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
