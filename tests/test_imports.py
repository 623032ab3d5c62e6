"""The import graph: the job's schema on the lowest floor, the checks that prepare a job above
the parts they check, so no import circle runs through either."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mgpu"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """{module: the mgpu modules it imports anywhere: top level, in functions, TYPE_CHECKING}."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}

    def owner(name: str) -> str | None:  # `mgpu.job.Job` → `mgpu.job`
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {owner(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([package.rsplit(".", node.level - 1)[0], base]).strip(".")
                targets |= {owner(f"{base}.{alias.name}") for alias in node.names}
        graph[name] = targets - {None, name}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_the_job_schema_imports_nothing_of_mgpu():
    assert import_graph()["mgpu.job"] == set()


def test_no_import_circle_runs_through_the_config_checks():
    """Every part may import the schema (`mgpu.job`); none may reach back to `mgpu.config`,
    which imports the support rules, the checkpoint check and the options it checks."""
    graph = import_graph()
    for module in ("mgpu.config", "mgpu.job", "mgpu.options", "mgpu.support"):
        assert module not in reachable(graph, module), module
