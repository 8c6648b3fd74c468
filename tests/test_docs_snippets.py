"""The code in the docs runs, so it cannot rot.

Every fenced code block of README.md, docs/plugins.md, docs/configuration.md, docs/engines.md,
docs/distributed.md and docs/testing.md is handled by its info string (documented in
docs/testing.md, "Code blocks in these docs"):

* ```` ```python ```` - executed, in order; the blocks of one document share a namespace;
* ```` ```python no-run ```` - shown only (needs a GPU, a network, or is a fragment);
* ```` ```<lang> file=PATH ```` - written to ``PATH`` in the document's scratch
  directory (appended when several blocks name the same file) instead of run;
  the scratch directory is the working directory and is on ``sys.path``, so
  later blocks import modules written this way and read ``mm3.toml`` files;
* ```` ```python file=PATH pytest ```` - written, then run with ``pytest`` in a
  subprocess in the scratch directory (a ``conftest.py`` block there loads mm3's fixtures); it must pass;
* ```` ```bash installed ```` - shown here; :func:`test_plugin_guide_package_installs_and_passes_check`
  pip-installs the ``file=`` blocks of docs/plugins.md as a package (into a
  throwaway virtual environment, never this one) and runs the block's ``mm3``
  commands against it;
* any other language (bash, toml, text) without ``file=`` - shown only.

Each document runs with no ``MM3_*`` variables, a fresh default registry, and
its environment, ``sys.path`` and modules restored afterwards. A deprecated mm3
name in a block (``mm3.Settings``...) fails it: the docs show the current API.
Every other Markdown file of README.md and docs/ has no runnable block (checked),
and a ``no-run`` block still compiles and imports from mm3 only names that exist.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import tomllib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
from plugin_fakes import PIP_OFFLINE, backends_row, pip_install_into, subprocess_env, throwaway_venv

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/plugins.md", "docs/configuration.md", "docs/testing.md", "docs/engines.md",
        "docs/distributed.md"]
MARKDOWN = ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]
# mm3's moved names warn "mm3.NAME moved: import it from ..." (mm3/__init__.py); in a snippet that is a failure
MM3_DEPRECATION = r"mm3\.\w+ moved"
KNOWN_FLAGS = {"no-run", "pytest", "installed"}
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


def write_file_block(b: Block, root: Path, written: set[Path]) -> Path:
    """Write a ``file=`` block under ``root``: a new file, or appended to one ``written`` before."""
    assert b.file is not None
    target = root / b.file
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "a" if target in written else "w") as f:
        f.write(b.code)
    written.add(target)
    return target


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
            target = write_file_block(b, scratch, written)
            if "pytest" in b.flags:
                r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    "-W", f"error:{MM3_DEPRECATION}:DeprecationWarning", str(target)], cwd=scratch, capture_output=True, text=True,
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
            with warnings.catch_warnings():
                warnings.filterwarnings("error", MM3_DEPRECATION, DeprecationWarning)
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


# docs/testing.md runs two conformance suites and a pytest session: tens of seconds, so `slow`
@pytest.mark.parametrize("doc", [pytest.param(d, marks=pytest.mark.slow) if d == "docs/testing.md" else d
                                 for d in DOCS])
def test_doc_snippets_run(doc: str, docs_sandbox: Path) -> None:
    path = REPO / doc
    assert path.is_file(), f"{doc} is missing"
    ran = run_document(path, docs_sandbox, label=doc)
    assert ran >= 1, f"{doc} has no runnable code block; mark examples ```python so they are tested"


@pytest.mark.parametrize("doc", MARKDOWN)
def test_every_python_block_is_run_or_marked(doc: str) -> None:
    """A python block is either executed, written to a file, or explicitly ``no-run``; a document
    with a block to execute is one of those the snippet test runs."""
    blocks = parse_blocks((REPO / doc).read_text())
    for b in blocks:
        if b.lang.startswith("py") and b.lang != "python":
            pytest.fail(f"{doc}:{b.line}: language {b.lang!r}; write ```python (and no-run if it must not run)")
        assert not (b.flags - KNOWN_FLAGS), f"{doc}:{b.line}: unknown flags {sorted(b.flags - KNOWN_FLAGS)}"
    runnable = [b.line for b in blocks if b.runs or "pytest" in b.flags]
    assert doc in DOCS or not runnable, f"{doc} has python blocks to run (lines {runnable}): add it to DOCS"


@pytest.mark.parametrize("doc", MARKDOWN)
def test_no_run_blocks_compile_and_import_what_exists(doc: str) -> None:
    """A ``no-run`` block is shown, not run; it must still be Python, and what it imports from mm3 must exist."""
    import ast
    import importlib

    for b in parse_blocks((REPO / doc).read_text()):
        if b.lang != "python" or "no-run" not in b.flags:
            continue
        tree = ast.parse(b.code, f"{doc}:{b.line}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mm3":
                module = importlib.import_module(node.module)  # type: ignore[arg-type]
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not missing, f"{doc}:{b.line}: {node.module} has no {missing}"


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
    doc.write_text("```python\nimport mm3\nsettings = mm3.Settings()\n```\n")
    with pytest.raises(SnippetError, match="DeprecationWarning: mm3.Settings moved"):
        run_document(doc, tmp_path)


# -- docs/plugins.md, followed to the letter -------------------------------------------------------
# The guide's `file=` blocks are a whole package; its `bash installed` block says how to install
# it and which `mm3` commands then work. The test writes the package into an empty directory,
# installs it as the guide says (`pip install -e .`, offline) into a throwaway virtual environment
# that sees this one's packages, and runs those commands with that environment's interpreter. This
# environment is left as it was, including a `my-attn` of the user's own.

GUIDE = REPO / "docs" / "plugins.md"
EXAMPLE = REPO / "examples" / "third_party_backend"


def _installed_block_commands(blocks: list[Block]) -> tuple[str, list[list[str]]]:
    """The install line and the ``mm3 ...`` command lines of the guide's one ``bash installed`` block."""
    found = [b for b in blocks if "installed" in b.flags]
    assert len(found) == 1 and found[0].lang == "bash", "docs/plugins.md needs exactly one ```bash installed block"
    lines = [ln.split("#", 1)[0].strip() for ln in found[0].code.splitlines()]
    install, *commands = [shlex.split(ln) for ln in lines if ln]
    assert all(cmd[0] == "mm3" for cmd in commands), f"only mm3 commands may follow the install line: {commands}"
    return " ".join(install), commands


def _mm3(args: list[str], cwd: Path, site: Optional[Path] = None,
         python: Path = Path(sys.executable)) -> subprocess.CompletedProcess[str]:
    """``mm3 ARGS`` as a user runs it: a fresh interpreter, no MM3_* settings, no Triton interpreter."""
    return subprocess.run([str(python), "-m", "mm3.cli", *args], cwd=cwd, env=subprocess_env(site),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow   # a venv, a pip install and `mm3 check` in fresh interpreters
def test_plugin_guide_package_installs_and_passes_check(tmp_path: Path) -> None:
    """Build the guide's package from its blocks alone, install it as it says, run its commands."""
    blocks = parse_blocks(GUIDE.read_text())
    project = tmp_path / "my-attn"
    written: set[Path] = set()
    for b in blocks:
        if b.file is not None:
            # The info string is invisible on a rendered page: the block's first line names the file.
            assert f"/{b.file}" in b.code.splitlines()[0], f"{GUIDE.name}:{b.line}: first line must name {b.file}"
            write_file_block(b, project, written)
    assert {p.relative_to(project).as_posix() for p in written} >= {"pyproject.toml", "my_attn/__init__.py",
                                                                       "my_attn/plugin.py"}
    install, commands = _installed_block_commands(blocks)
    assert install == "pip install -e .", install
    assert [cmd[1] for cmd in commands] == ["backends", "check"], commands
    name = commands[1][2]
    with open(project / "pyproject.toml", "rb") as f:
        meta = tomllib.load(f)["project"]

    python = throwaway_venv(tmp_path / "venv")
    r = subprocess.run([str(python), *PIP_OFFLINE, "install", "--quiet", "--no-deps", "--no-build-isolation",
                        "--no-index", "-e", "."], cwd=project, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"pip install -e {project} failed:\n{r.stdout}\n{r.stderr}"
    imported = subprocess.run([str(python), "-c", "import my_attn; print(my_attn.__file__)"], cwd=tmp_path,
                              env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr
    where = imported.stdout.strip()
    if not Path(where).is_relative_to(project):
        pytest.skip(f"a `my_attn` installed in this environment ({where}) shadows the guide's package")

    listed = _mm3(commands[0][1:], tmp_path, python=python)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    row = backends_row(listed.stdout, name)
    assert row is not None, f"{name} missing from `mm3 backends`:\n{listed.stdout}"
    assert row[1] == f"{meta['name']} {meta['version']}" and row[2] == "yes", row  # SOURCE, AVAILABLE
    assert "problems: none" in listed.stdout, listed.stdout

    checked = _mm3(commands[1][1:], tmp_path, python=python)
    assert checked.returncode == 0, checked.stdout[-6000:] + checked.stderr[-2000:]
    assert name in checked.stdout, checked.stdout


def _fake_installed_distribution(site: Path, name: str, version: str, url: str) -> list[str]:
    """A distribution as pip leaves it in ``site`` (METADATA, INSTALLER, direct_url.json, RECORD); its files."""
    from mm3.testing.helpers import write_distribution

    write_distribution(site, name, version)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    (info / "INSTALLER").write_text("pip\n")
    (info / "direct_url.json").write_text(json.dumps({"url": url, "dir_info": {"editable": True}}))
    files = sorted([*(p.name for p in info.iterdir()), "RECORD"])
    (info / "RECORD").write_text("".join(f"{info.name}/{file},,\n" for file in files))
    return [f"{info.name}/{file}" for file in files]


@pytest.mark.slow   # the test above, in a pytest session of its own
def test_plugin_guide_test_leaves_an_installed_my_attn_alone(tmp_path: Path) -> None:
    """A user who followed the guide has their own `my-attn` (installed from a folder under the temp
    directory); the guide's test, run in their environment, must leave it installed.

    The user's environment is a throwaway one here, with the distribution in its site-packages; the
    guide's test runs in it through pytest, as the user's suite run would run it."""
    user = throwaway_venv(tmp_path / "user-venv")
    site = Path(subprocess.run([str(user), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    their_project = Path(tempfile.mkdtemp(dir=tmp_path)) / "my-attn"
    before = _fake_installed_distribution(site, "my-attn", "0.0.7", their_project.as_uri())
    r = subprocess.run([str(user), "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-p", "no:randomly",
                        "-m", "slow", f"{Path(__file__).resolve()}::test_plugin_guide_package_installs_and_passes_check"],
                       cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
    after = subprocess.run([str(user), "-c", "import importlib.metadata as m; print(m.version('my-attn'))"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert after.stdout.strip() == "0.0.7", f"the user's my-attn is gone or replaced:\n{after.stdout}{after.stderr}"
    assert sorted(p.relative_to(site).as_posix() for p in site.glob("my_attn-0.0.7.dist-info/*")) == before


def test_plugin_guide_rename_table_turns_the_example_into_a_new_backend(tmp_path: Path) -> None:
    """"Start from the example instead": the renames the guide lists are all it takes."""
    table = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \|", GUIDE.read_text(), flags=re.MULTILINE)
    renames = dict(table)
    assert renames.get("torch_sdpa_sparse") and renames.get("mm3_sdpa_sparse"), table
    copy = tmp_path / "copy"
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    (copy / "src" / "mm3_sdpa_sparse").rename(copy / "src" / renames["mm3_sdpa_sparse"])
    for path in (p for p in copy.rglob("*") if p.is_file()):
        text = path.read_text()
        for old, new in renames.items():
            text = text.replace(old, new)
        path.write_text(text)
        assert "sdpa_sparse" not in text.lower().replace("test_sdpa_sparse", ""), f"{path}: an old name survives"

    site = tmp_path / "site"
    pip_install_into(copy, site)
    listed = _mm3(["backends", "--device", "cpu"], tmp_path, site)
    new_name, new_dist = renames["torch_sdpa_sparse"], renames["mm3-sdpa-sparse"]
    row = backends_row(listed.stdout, new_name)
    assert row is not None and row[1].startswith(f"{new_dist} ") and row[2] == "yes", listed.stdout
    assert "problems: none" in listed.stdout, listed.stdout


# -- signatures the README's tables show -----------------------------------------------------------

_CALL_CELL = re.compile(r"^\| `((?:mm3\.)?[A-Z]\w*(?:\.\w+)?)\(([^`]*)\)` \|", re.MULTILINE)


def test_readme_signatures_match_the_code() -> None:
    """A call shown in a README table (`BatchMetadata.build(query_lens, ..., *, block_size, ...)`) has the
    code's parameters: each shown default is the real one, a parameter shown without one has none."""
    import ast
    import inspect

    import mm3

    shown = _CALL_CELL.findall((REPO / "README.md").read_text())
    assert any(name == "BatchMetadata.build" for name, _ in shown), shown
    for name, args in shown:
        obj: object = mm3
        for part in name.removeprefix("mm3.").split("."):
            obj = getattr(obj, part)
        real = inspect.signature(obj).parameters  # type: ignore[arg-type]
        fn = ast.parse(f"def f({args.replace('=...', '=None')}): pass").body[0]
        assert isinstance(fn, ast.FunctionDef)
        a = fn.args
        params = [(p.arg, d) for p, d in zip(a.args, [None] * (len(a.args) - len(a.defaults)) + a.defaults)]
        params += [(p.arg, d) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
        for arg, default in params:
            assert arg in real, f"README: {name}() has no parameter {arg!r}"
            p = real[arg]
            if default is None:
                assert p.default is inspect.Parameter.empty, f"README: {name}({arg}) has a default ({p.default!r})"
            else:
                assert p.default == ast.literal_eval(default), (
                    f"README shows {name}({arg}={ast.unparse(default)}) but the default is {p.default!r}")
            if arg in {k.arg for k in a.kwonlyargs}:
                assert p.kind is inspect.Parameter.KEYWORD_ONLY, f"README: {name}({arg}) is not keyword-only"
        required = [n for n, p in real.items() if p.default is inspect.Parameter.empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        assert not set(required) - {arg for arg, _ in params}, f"README omits required {name}() parameters"
