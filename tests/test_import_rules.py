"""Which package may import which, read from the source with ``ast`` (every import, function-local ones too):
model/ has no import cycle; benchmarks/ never imports tests/; the engine never imports the HTTP layer; only the HTTP
layer reads the pydantic schemas."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The modules ``path`` imports (``from a.b import c`` counts as a.b and a.b.c: c may be a module)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_model_has_no_import_cycle():
    modules = {module_name(p): p for p in sources("model")}
    graph = {name: {m for m in imports(path) if m in modules and m != name} for name, path in modules.items()}
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for other in sorted(graph[name]):
            assert state.get(other) != "open", "import cycle: " + " -> ".join([*trail, name, other])
            if other not in state:
                visit(other, [*trail, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def offenders(folder: str, forbidden: str) -> list[str]:
    return [f"{path.relative_to(ROOT)}: {name}" for path in sources(folder) for name in sorted(imports(path))
            if name == forbidden or name.startswith(forbidden + ".")]


def test_benchmarks_do_not_import_tests():
    assert offenders("benchmarks", "tests") == []


def test_the_engine_does_not_import_the_http_layer():
    assert offenders("service/engine", "service.api") == []
    for framework in ("fastapi", "starlette", "pydantic"):
        assert offenders("service/engine", framework) == []


def test_only_the_http_layer_reads_the_request_schemas():
    outside = [p for p in sources("service") if "api" not in p.relative_to(ROOT / "service").parts[:1]]
    readers = [p for p in outside if any(m.startswith("service.api.schemas") for m in imports(p))]
    assert [str(p.relative_to(ROOT)) for p in readers] == []
