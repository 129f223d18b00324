"""The packages stack one way: every import goes down the declared layer order, and no import
cycle exists anywhere (imports inside functions and under TYPE_CHECKING count too).

Read from the source with `ast`, so the test sees what the code says, not what happens to be
imported at run time.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LAYERS = (
    "schedule",
    "config",
    "comm",
    "parallel",
    "runtime",
    "checkpoint",
    "memory",
    "plan",
    "training",
    "cli",
)
"""engine's subpackages, lowest first: each may import its own package and those before it."""

TOP = ("models", "partitioners", "engine")
"""The top-level packages, lowest first."""

NO_DISTRIBUTED = ("engine.schedule", "engine.config", "partitioners", "models")
"""Plain data and pure functions: no torch.distributed import anywhere in them."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    return {
        _module_name(path): path
        for package in TOP
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.name != "__main__.py"
    }


def _imports(path: Path) -> Iterator[str]:
    """Every module `path` imports, wherever the import statement stands."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


SOURCES = _sources()


def _graph() -> dict[str, set[str]]:
    """Module → the project modules it imports (`from pkg import name` of a submodule counts
    as importing that submodule, of anything else as importing `pkg`)."""
    return {
        name: {imported for imported in _imports(path) if imported in SOURCES} - {name}
        for name, path in SOURCES.items()
    }


def _layer(module: str) -> tuple[int, int]:
    """(top-level package index, engine subpackage index) of a module; the engine package's
    own `__init__` sits above every subpackage."""
    parts = module.split(".")
    top = TOP.index(parts[0])
    if parts[0] != "engine":
        return top, 0
    return top, LAYERS.index(parts[1]) if len(parts) > 1 else len(LAYERS)


def test_every_engine_subpackage_has_a_declared_layer() -> None:
    found = {p.name for p in (ROOT / "engine").iterdir() if (p / "__init__.py").is_file()}
    assert found <= set(LAYERS), f"add {sorted(found - set(LAYERS))} to LAYERS in this test"


def test_no_module_imports_from_a_higher_layer() -> None:
    upward = [
        f"{module} imports {imported}"
        for module, imports in _graph().items()
        for imported in imports
        if _layer(imported) > _layer(module)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return [*stack[stack.index(imported) :], imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


@pytest.mark.parametrize("package", NO_DISTRIBUTED)
def test_plain_data_packages_do_not_import_torch_distributed(package: str) -> None:
    offenders = [
        f"{module} imports {imported}"
        for module, path in SOURCES.items()
        if module == package or module.startswith(package + ".")
        for imported in _imports(path)
        if imported == "torch.distributed" or imported.startswith("torch.distributed.")
    ]
    assert not offenders, "\n".join(offenders)


def test_every_module_declares_its_public_names() -> None:
    missing = [
        module
        for module, path in SOURCES.items()
        if "__all__" not in path.read_text(encoding="utf-8")
    ]
    assert not missing, f"modules without __all__: {missing}"


_STARTUP_HEAVY = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp", "sympy")
"""What a process imports only where a run uses it (tensor parallelism, ZeRO-3, compile):
seconds of every command's start on a small CPU (`engine.comm.dtensor`)."""


def test_the_cli_and_a_model_built_on_meta_import_no_dtensor_fsdp_or_dynamo() -> None:
    """In a fresh process, as a command starts: the whole CLI imported and a model's layers
    built on meta (parameter counts, as `meshpipe plan` and `memory` take them)."""
    script = (
        "import sys; import engine.cli.main; from models import layer_specs; "
        "[spec.num_parameters() for spec in layer_specs('llama-tiny')]; "
        f"print([m for m in {_STARTUP_HEAVY!r} if m in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout
