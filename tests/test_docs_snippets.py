"""The code in the docs runs, so it cannot rot.

Every fenced code block of README.md, docs/plugins.md, docs/configuration.md
and docs/testing.md is handled by its info string (documented in
docs/testing.md, "Code blocks in these docs"):

* ```` ```python ```` - executed, in order; the blocks of one document share a namespace;
* ```` ```python no-run ```` - shown only (needs a GPU, a network, or is a fragment);
* ```` ```<lang> file=PATH ```` - written to ``PATH`` in the document's scratch
  directory (appended when several blocks name the same file) instead of run;
  the scratch directory is the working directory and is on ``sys.path``, so
  later blocks import modules written this way and read ``mm3.toml`` files;
* ```` ```python file=PATH pytest ```` - written, then run with ``pytest`` in a
  subprocess (mm3's fixtures come from its pytest plugin); it must pass;
* any other language (bash, toml, text) without ``file=`` - shown only.

Each document runs with no ``MM3_*`` variables, a fresh default registry, and
its environment, ``sys.path`` and modules restored afterwards.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/plugins.md", "docs/configuration.md", "docs/testing.md"]
KNOWN_FLAGS = {"no-run", "pytest"}
_FENCE = re.compile(r"^(?P<indent>[ ]{0,3})(?P<fence>`{3,})(?P<info>[^`]*)$")


@dataclass(frozen=True)
class Block:
    """One fenced code block: language, flags, ``file=`` target, code and its first line number."""

    lang: str
    flags: frozenset[str]
    file: Optional[str]
    code: str
    line: int

    @property
    def runs(self) -> bool:
        return self.lang == "python" and self.file is None and "no-run" not in self.flags


def parse_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a markdown text, in order."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group("fence"), m.group("info").split()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        lang = info[0] if info else ""
        flags = {tok for tok in info[1:] if "=" not in tok}
        attrs = dict(tok.split("=", 1) for tok in info[1:] if "=" in tok)
        blocks.append(Block(lang, frozenset(flags), attrs.get("file"),
                            textwrap.dedent("\n".join(body)) + "\n", start + 1))
    return blocks


class SnippetError(AssertionError):
    """A documented code block failed; the message shows where and the block itself."""


def run_document(path: Path, scratch: Path, label: Optional[str] = None) -> int:
    """Run ``path``'s blocks in ``scratch`` as described in the module docstring; return how many ran."""
    label = label or str(path)
    blocks = parse_blocks(path.read_text())
    namespace: dict[str, object] = {"__name__": "__docs__"}
    written: set[Path] = set()
    ran = 0
    for b in blocks:
        where = f"{label}:{b.line}"
        unknown = b.flags - KNOWN_FLAGS
        if unknown:
            raise SnippetError(f"{where}: unknown code block flag(s) {sorted(unknown)}; use "
                               f"{sorted(KNOWN_FLAGS)} or file=PATH (see docs/testing.md)")
        if b.file is not None:
            target = scratch / b.file
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "a" if target in written else "w") as f:
                f.write(b.code)
            written.add(target)
            if "pytest" in b.flags:
                r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    str(target)], cwd=scratch, capture_output=True, text=True,
                                   timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                       [str(scratch), *filter(None, [os.environ.get("PYTHONPATH")])])})
                if r.returncode != 0:
                    raise SnippetError(f"{where}: pytest on {b.file} failed:\n{r.stdout[-3000:]}\n"
                                       f"{r.stderr[-2000:]}")
                ran += 1
            continue
        if not b.runs:
            continue
        try:
            exec(compile(b.code, where, "exec"), namespace)
        except BaseException as e:  # noqa: BLE001 - report any failure with its block
            raise SnippetError(f"{where}: {type(e).__name__}: {e}\n--- block ---\n{b.code}") from e
        ran += 1
    return ran


@pytest.fixture
def docs_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """cwd and sys.path in a scratch dir, no MM3_* settings, fresh default registry; undone after."""
    from mm3.runtime.config import RESERVED_ENV_PREFIXES
    from mm3.runtime.registry import reset_default_registry

    saved_env = dict(os.environ)
    for key in list(os.environ):
        if key.upper().startswith("MM3_") and not key.upper().startswith(RESERVED_ENV_PREFIXES):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    reset_default_registry()
    yield tmp_path
    reset_default_registry()
    # Snippets may set variables directly (os.environ[...] = ...): restore exactly.
    os.environ.clear()
    os.environ.update(saved_env)
    for name in set(sys.modules) - before:
        mod = sys.modules.get(name)
        if getattr(mod, "__file__", None) and Path(mod.__file__).is_relative_to(tmp_path):  # type: ignore[union-attr, arg-type]
            del sys.modules[name]


@pytest.mark.parametrize("doc", DOCS)
def test_doc_snippets_run(doc: str, docs_sandbox: Path) -> None:
    path = REPO / doc
    assert path.is_file(), f"{doc} is missing"
    ran = run_document(path, docs_sandbox, label=doc)
    assert ran >= 1, f"{doc} has no runnable code block; mark examples ```python so they are tested"


@pytest.mark.parametrize("doc", DOCS)
def test_every_python_block_is_run_or_marked(doc: str) -> None:
    """A python block is either executed, written to a file, or explicitly ``no-run``."""
    for b in parse_blocks((REPO / doc).read_text()):
        if b.lang.startswith("py") and b.lang != "python":
            pytest.fail(f"{doc}:{b.line}: language {b.lang!r}; write ```python (and no-run if it must not run)")
        assert not (b.flags - KNOWN_FLAGS), f"{doc}:{b.line}: unknown flags {sorted(b.flags - KNOWN_FLAGS)}"


def test_the_runner_catches_a_broken_snippet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner itself must be able to fail: a wrong snippet, a wrong file, a typo'd flag."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    doc = tmp_path / "doc.md"
    doc.write_text(textwrap.dedent("""
        ```toml file=conf/settings.toml
        answer = 41
        ```

        ```python
        import tomllib
        value = tomllib.load(open("conf/settings.toml", "rb"))["answer"]
        ```

        ```python no-run
        raise SystemExit("never runs")
        ```

        ```python
        assert value == 42, "the documented value is wrong"
        ```
    """))
    with pytest.raises(SnippetError, match=r"doc.md:\d+: AssertionError: the documented value is wrong"):
        run_document(doc, tmp_path)
    doc.write_text(doc.read_text().replace("answer = 41", "answer = 42"))
    assert run_document(doc, tmp_path) == 2
    doc.write_text("```python norun\nprint('typo in the flag')\n```\n")
    with pytest.raises(SnippetError, match="unknown code block flag"):
        run_document(doc, tmp_path)
