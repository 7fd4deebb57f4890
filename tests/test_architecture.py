"""docs/architecture.md is the design the code cites: every ``docs/architecture.md section N``
in the project names a section that exists, and nothing cites a design users do not have."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITATION = re.compile(r"docs/architecture\.md,? sections? ([0-9][0-9, and]*)")


def sections() -> set[int]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return {int(n) for n in re.findall(r"^## ([0-9]+)\. ", text, re.M)}


def cited() -> dict[str, set[int]]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    out: dict[str, set[int]] = {}
    for name in files:
        if not name.endswith((".py", ".proto", ".toml", ".md")) or name == "docs/architecture.md":
            continue
        text = (ROOT / name).read_text(errors="replace")
        for match in CITATION.finditer(text):
            out.setdefault(name, set()).update(int(n) for n in re.findall(r"[0-9]+", match.group(1)))
    return out


def test_the_sections_are_numbered_in_order() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    numbers = [int(n) for n in re.findall(r"^## ([0-9]+)\. ", text, re.M)]
    assert numbers == list(range(1, len(numbers) + 1)), numbers
    assert len(numbers) >= 9


def test_every_cited_section_exists() -> None:
    found = cited()
    assert len(found) >= 10, "the code cites its design"
    have = sections()
    missing = {name: sorted(n - have) for name, n in found.items() if n - have}
    assert not missing, f"citations of sections docs/architecture.md lacks: {missing}"


def test_no_citation_of_a_file_users_do_not_have() -> None:
    files = subprocess.run(["git", "grep", "-l", "ARCHITECTURE\\.md", "--", "*.py", "*.proto", "*.toml"],
                           cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert files == [], f"cite docs/architecture.md instead, in {files}"


def test_the_citation_pattern_reads_lists() -> None:
    assert [m.group(1) for m in CITATION.finditer("see docs/architecture.md sections 5 and 6.")] == ["5 and 6"]


PACKAGES = {"kvlayer": "kvlayer", "connectors": "kvlayer.connectors", "backends": "kvlayer.backends",
            "controller": "kvlayer.controller", "engine": "kvlayer.engine", "benchmarks": "kvlayer.benchmarks"}


def tracked(suffix: str) -> list[str]:
    files = subprocess.run(["git", "ls-files", f"*{suffix}"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return [f for f in files if (ROOT / f).exists() and not f.endswith(("_pb2.py", "_pb2_grpc.py"))]


def test_every_file_is_at_most_400_lines() -> None:
    long = {f: n for f in tracked(".py") if (n := len((ROOT / f).read_text().splitlines())) > 400}
    assert not long, f"split these (one idea per file): {long}"


def module_of(path: str) -> str | None:
    parts = path[:-3].split("/")
    if parts[0] not in PACKAGES:
        return None
    rest = parts[1:-1] if parts[-1] == "__init__" else parts[1:]
    return ".".join([PACKAGES[parts[0]], *rest])


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere (module level or inside functions)."""
    import ast

    mods = {m: f for f in tracked(".py") if (m := module_of(f)) is not None}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                names = subs if len(subs) == len(node.names) else [*subs, base]
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].add(name)
    return graph


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = import_graph()
    assert len(graph) > 50
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_check_sees_imports_inside_functions() -> None:
    graph = import_graph()
    assert "kvlayer.controller.agent" in graph["kvlayer.connectors.controller_link"], \
        "the controller link imports the agent inside a function"


def test_the_controller_agent_acts_only_through_kvcacheengine() -> None:
    text = (ROOT / "controller" / "agent_commands.py").read_text()
    assert ".tiers" not in text and ".backends" not in text, "admin goes through KVCacheEngine's operations"
