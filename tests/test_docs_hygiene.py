"""Documentation and comments say what is and why, not when: git keeps the history.

The rule, for every tracked file outside ``benchmarks/results/`` (a run's raw output):

* what is checked: every line of a Markdown file, a shell script's comments,
  and a Python file's comments and docstrings (not its other string literals:
  messages and data may hold anything);
* what fails: a date (``2026-12-03``), a session (``session 6``, ``s7 r2``),
  a run id (``r1`` .. ``r9``, ``r3_*``), an issue number (``issue 13``), or
  a pointer into the deleted notebook (``NOTES.md``): the words of a lab
  notebook, which say when something was measured or changed instead of what
  is true (a path into ``benchmarks/results/`` is a file name, not prose);
* one exception: ``BENCHMARKS.md`` gives each table its date, device and
  command (dates only: no sessions, no run ids).

A figure with its device ("70 us on the H200") is a fact and may stay where
it explains a choice; its date, session or run is history.

``HISTORY_PENDING`` lists files another change is cleaning; each must still
have a hit (a clean file must leave the list), so the list only shrinks.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Spelled in pieces so that this file does not trip its own patterns.
PATTERNS = {
    "date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "session": re.compile(r"\b[Ss]ession[s]?[ -]?\(?\d+|\bs\d+ r\d\b|" + r"-s\d+/"),
    "run id": re.compile(r"(?<![\w./-])r[1-9](?:_\*|_\w+|\b)(?![.\w]*\()"),
    "issue": re.compile(r"\b[Ii]ssues? \d+"),
    "notebook": re.compile(r"\bNOTES" + r"(\.md\b| §)"),
}
_RESULTS_PATH = re.compile(r"benchmarks/results/\S*")
DATES_ALLOWED = {"BENCHMARKS.md"}

HISTORY_PENDING: dict[str, str] = {}


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [REPO / n for n in out.decode().split("\0") if n and not n.startswith("benchmarks/results/")]


def _python_prose(text: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring line of Python source ``text``."""
    out: list[tuple[int, str]] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                out.append((tok.start[0], tok.string))
        tree = ast.parse(text)
    except (tokenize.TokenError, SyntaxError):
        return [(i, line) for i, line in enumerate(text.splitlines(), 1)]
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                first = body[0].lineno
                out += [(first + i, line) for i, line in enumerate(body[0].value.value.splitlines())]
    return out


def _prose(path: Path) -> list[tuple[int, str]]:
    text = path.read_text(errors="replace")
    if path.suffix == ".py":
        return _python_prose(text)
    if path.suffix == ".sh":
        return [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.lstrip().startswith("#")]
    if path.suffix == ".md":
        return list(enumerate(text.splitlines(), 1))
    return []


def history_hits(paths: list[Path], root: Path = REPO) -> list[str]:
    """``path:line: [kind] text`` for every line that reads like a lab notebook."""
    hits = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        for number, line in _prose(path):
            line = _RESULTS_PATH.sub("benchmarks/results/", line)
            for kind, pattern in PATTERNS.items():
                if kind == "date" and rel in DATES_ALLOWED:
                    continue
                if pattern.search(line):
                    hits.append(f"{rel}:{number}: [{kind}] {line.strip()[:120]}")
    return hits


def test_no_file_tells_its_history() -> None:
    files = [p for p in _tracked() if p.suffix in (".py", ".md", ".sh") and p != Path(__file__).resolve()]
    hits = history_hits(files)
    pending = [h for h in hits if h.split(":")[0] in HISTORY_PENDING]
    fresh = [h for h in hits if h.split(":")[0] not in HISTORY_PENDING]
    assert not fresh, ("say what is and why, not when (git keeps the history; BENCHMARKS.md alone dates its "
                       "tables):\n" + "\n".join(fresh))
    cleaned = sorted(set(HISTORY_PENDING) - {h.split(":")[0] for h in pending})
    assert not cleaned, f"these files are clean now: remove them from HISTORY_PENDING: {cleaned}"


def test_the_rule_catches_a_lab_notebook(tmp_path: Path) -> None:
    """Each pattern on a planted line fails; the same words that are not history pass."""
    bad = {
        "a.md": "Measured on the H200 (2026-12-03) after the change.\n",
        "b.py": "x = 1  # session 6 chose this, see r3_results\n",
        "c.py": '"""The rule as the default (r2)."""\n',
        "d.sh": "# issue 13: before the fix\n",
        "g.md": "Why: see benchmarks/NOTES.md §5.\n",
        "BENCHMARKS.md": "H200, 2026-12-03: step 323 us (session 7, r2)\n",
    }
    good = {
        "e.py": 'MSG = "2026-12-03 session 6 r2"\n@fixture(scope="session")\ndef f(r1, r2): return r1.start\n',
        "f.md": "The merge runs in the last program; see docs/spec.md §4 (r = rank, s = split).\n"
                "Raw output: benchmarks/results/h200-2026-12-03-s7/r2_results.md; 70 us on the H200.\n",
        "BENCHMARKS.md": "H200, 2026-12-03, `mm3 bench --only decode`: step 323 us\n",
    }
    want_bad = {"a.md": {"date"}, "b.py": {"session", "run id"}, "c.py": {"run id"}, "d.sh": {"issue"},
                "g.md": {"notebook"}, "BENCHMARKS.md": {"session", "run id"}}
    for files, want in ((bad, want_bad), (good, {})):
        for old in tmp_path.iterdir():
            old.unlink()
        for name, text in files.items():
            (tmp_path / name).write_text(text)
        got: dict[str, set[str]] = {}
        for hit in history_hits(sorted(tmp_path.iterdir()), root=tmp_path):
            got.setdefault(hit.split(":")[0], set()).add(hit.split("[")[1].split("]")[0])
        assert got == want, got
