"""The repository explains itself: no pointer to documents outside it, no dead link inside it.

The contract lives in docs/spec.md and the design in docs/architecture.md.
A reference to a document that only exists outside the repository (an old
team SPEC or DESIGN file, a path into a sibling folder) is a dead end for a
user on a fresh machine, and so is a relative markdown link to a file or a
heading that does not exist.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Spelled in pieces so that this file does not match its own patterns.
_OUTSIDE = re.compile("|".join([
    r"\bSPEC" + r"\.md\b",
    r"\bDESIGN" + r"\.md\b",
    r"\bSPEC" + r" §",
    r"\bDESIGN" + r" §",
    r"\.\./" + r"shared\b",
]))
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s{0,3}(```|~~~)")


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [REPO / name for name in out.decode().split("\0") if name]


def _text(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def outside_references(paths: list[Path]) -> list[str]:
    """``path:line: text`` for every line that points at a document outside the repository."""
    hits = []
    for path in paths:
        text = _text(path) if path.is_file() else None
        for number, line in enumerate((text or "").splitlines(), 1):
            if _OUTSIDE.search(line):
                hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    return hits


def test_no_file_points_outside_the_repository() -> None:
    hits = outside_references(_tracked_files())
    assert not hits, ("these lines refer to documents that are not in the repository; point them at "
                      "docs/spec.md (§1-§7) or docs/architecture.md instead:\n" + "\n".join(hits))


def test_the_check_catches_an_outside_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    lines = ["see SPEC" + " §3", "as SPEC" + ".md says", "../" + "shared/DESIGN" + ".md", "docs/spec.md §3",
             "TritonPluginSpec(SPEC)"]
    files = []
    for i, line in enumerate(lines):
        files.append(tmp_path / f"f{i}.py")
        files[-1].write_text(f"# {line}\n")
    assert [hit.split(":")[0] for hit in outside_references(files)] == ["f0.py", "f1.py", "f2.py"]


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings of a markdown text (fenced code skipped)."""
    anchors, seen, fenced = set(), {}, False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def dead_links(path: Path) -> list[str]:
    """Relative links of markdown file ``path`` whose file or heading does not exist."""
    bad = []
    text = path.read_text()
    for target in _LINK.findall(re.sub(r"```.*?```", "", text, flags=re.DOTALL)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{path.relative_to(REPO)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text()):
            bad.append(f"{path.relative_to(REPO)}: {target} (no such heading in {dest.name})")
    return bad


def test_relative_links_in_the_docs_resolve() -> None:
    docs = [p for p in _tracked_files() if p.suffix == ".md" and "benchmarks/results" not in p.as_posix()]
    bad = [b for p in docs for b in dead_links(p)]
    assert not bad, "dead links:\n" + "\n".join(bad)


def test_the_link_check_catches_dead_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "spec.md").write_text("# Title\n\n## 3. Indexer: choose the blocks\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](spec.md#3-indexer-choose-the-blocks) [ok](#top) [web](https://example.org/x)\n"
                    "[gone](missing.md) [moved](spec.md#3-the-indexer)\n\n# Top\n"
                    "```text\n[not a link](nowhere.md)\n```\n")
    assert dead_links(page) == ["page.md: missing.md (no such file)",
                                "page.md: spec.md#3-the-indexer (no such heading in spec.md)"]


def test_spec_keeps_its_section_numbers() -> None:
    """Code and docs cite "docs/spec.md §n": the numbered sections must stay where they are."""
    anchors = heading_anchors((REPO / "docs" / "spec.md").read_text())
    for n, title in [(1, "parameters"), (2, "inputs-of-one-step"), (3, "indexer-choose-the-blocks"),
                     (4, "attention-attend-to-the-chosen-blocks"), (5, "the-top-k-buffer"), (6, "the-oracle"),
                     (7, "the-hooks")]:
        assert f"{n}-{title}" in anchors, f"docs/spec.md lost section §{n} ({title})"
