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
