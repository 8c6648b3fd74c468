"""The example third-party backend, installed for real, next to mm3.

``examples/third_party_backend`` is built and installed with pip into a
temporary target directory (one install per test session); every check then
runs in a fresh interpreter with that directory on ``PYTHONPATH``, so the
backend is found exactly as a user's would be: through the ``mm3.backends``
entry point of an installed distribution, never through this repository.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from plugin_fakes import backends_row as _row
from plugin_fakes import pip_install_into, subprocess_env

# a real pip install, then a fresh interpreter per check: the slow command runs them (CI runs both)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "third_party_backend"
BACKEND = "torch_sdpa_sparse"


def _example_project() -> dict:
    with open(EXAMPLE / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


PROJECT = _example_project()
DIST, VERSION = PROJECT["name"], PROJECT["version"]


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pip install of the example (from a copy, so the build leaves nothing in the repo)."""
    root = tmp_path_factory.mktemp("third_party")
    src = root / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = root / "site"
    pip_install_into(src, target)
    assert (target / f"{DIST.replace('-', '_')}-{VERSION}.dist-info").is_dir()
    return target


def _run(args: list[str], site: Path, cwd: Path, timeout: int = 240,
         **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=subprocess_env(site, **env), capture_output=True, text=True,
                          timeout=timeout)


def _mm3(args: list[str], site: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "mm3.cli", *args], site, cwd, **env)


def test_installed_package_is_the_one_imported(site: Path, tmp_path: Path) -> None:
    code = ("import importlib.metadata as m, mm3_sdpa_sparse as p; "
            "print(p.__file__); print(p.__version__); print(m.version(p.DISTRIBUTION))")
    r = _run([sys.executable, "-c", code], site, tmp_path)
    assert r.returncode == 0, r.stderr
    path, version, meta = r.stdout.split()
    assert Path(path).is_relative_to(site), f"imported from {path}, not from the install in {site}"
    assert version == meta == VERSION


def test_discovered_with_provenance(site: Path, tmp_path: Path) -> None:
    r = _mm3(["backends", "--device", "cpu"], site, tmp_path)
    assert r.returncode == 0, r.stderr
    row = _row(r.stdout, BACKEND)
    assert row is not None, f"{BACKEND} missing from `mm3 backends`:\n{r.stdout}"
    # NAME, SOURCE, AVAILABLE, TOPK LAYOUT, KV, OPS, PRIORITY, AUTO, REASON
    assert row[1] == f"{DIST} {VERSION}", row
    assert row[2] == "yes" and row[3] == "token_major (contiguous)" and row[5] == "attention", row
    assert "problems: none" in r.stdout
    # The built-ins are still there, next to the third-party backend.
    assert _row(r.stdout, "cpu_ref")[1].startswith("mm3 ")  # type: ignore[index]

    j = _mm3(["backends", "--device", "cpu", "--json"], site, tmp_path)
    data = json.loads(j.stdout)
    ours = next(b for b in data["backends"] if b["name"] == BACKEND)
    assert (ours["distribution"], ours["version"], ours["entry_point"]) == (DIST, VERSION, BACKEND)
    assert ours["topk_layout"] == "token_major" and ours["topk_requires_contiguous"] is True
    # An attention-only backend composes: auto takes its attention and another backend's indexer.
    assert data["auto"] == {"attention": BACKEND, "indexer": "cpu_ref"}, data["auto"]
    assert "top-k buffer converted each step" in r.stdout
    # That installing it changes what auto picks is the plugin guide's word, where a reader meets it.
    auto = next(line for line in r.stdout.splitlines() if line.startswith("auto picks"))
    assert auto.startswith(f"auto picks attention={BACKEND}, indexer=cpu_ref ")
    guide = " ".join((Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text().split())
    assert "**Installing it changes what `auto` picks.**" in guide
    assert f"`auto picks attention={BACKEND}, indexer=cpu_ref ... (top-k buffer converted each step)`" in guide


# Runs one step through SparseAttention as configured by env/files, checks it against the fp64
# oracle and prints the choice.
STEP = textwrap.dedent("""
    import json, torch
    from mm3.runtime.config import Settings
    from mm3.runtime.layer import SparseAttention
    from mm3.testing.helpers import CaseFactory, default_params
    from mm3.testing.oracle import check_topk, oracle_attention

    p = default_params()
    case = CaseFactory(seed=11)(p, decode_query_len=2)
    layer = SparseAttention(p, dtype=torch.float32, max_num_tokens=80, max_decode_query_len=2)
    out = layer(case.q, case.index_q, case.caches, case.batch)
    sel = layer.topk_buffer.rows(0, case.batch.num_tokens)
    bad = check_topk(sel, case.index_q, case.caches, case.batch, p)
    ref = oracle_attention(case.q, case.caches, sel, case.batch, p)
    s = layer.selection
    print(json.dumps({"source": Settings().sources()["backend"], "attention": s.attention.name, "indexer": s.indexer.name,
                      "attention_dist": s.attention.source.dist_label, "conversion": s.topk_conversion,
                      "bad_rows": len(bad), "max_err": float((out.double() - ref).abs().max()),
                      "explain": layer.explain()}))
""")


def _step(site: Path, cwd: Path, **env: str) -> dict:
    r = _run([sys.executable, "-c", STEP], site, cwd, **env)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _assert_served_by_example(got: dict) -> None:
    assert got["attention"] == BACKEND and got["attention_dist"] == f"{DIST} {VERSION}", got
    assert got["indexer"] == "cpu_ref", got
    assert got["bad_rows"] == 0 and got["max_err"] < 1e-5, got
    # cpu_ref writes head-major, the example reads dense token-major: the core converts, and says so.
    assert "head_major" in got["conversion"] and "token_major" in got["conversion"], got
    assert "top-k conversion:" in got["explain"]


def test_selected_by_environment(site: Path, tmp_path: Path) -> None:
    got = _step(site, tmp_path, MM3_BACKEND=BACKEND)
    _assert_served_by_example(got)
    assert "named by backend" in got["explain"] and got["source"] == "env MM3_BACKEND"


def test_selected_by_config_file(site: Path, tmp_path: Path) -> None:
    (tmp_path / "mm3.toml").write_text(f'backend = "{BACKEND}"\nindexer_backend = "cpu_ref"\n')
    got = _step(site, tmp_path)
    _assert_served_by_example(got)
    assert got["source"] == f"file {tmp_path / 'mm3.toml'}"
    # The same file can switch it off again: a deny-list beats the name.
    (tmp_path / "mm3.toml").write_text(f'disable_plugins = ["{BACKEND}"]\n')
    r = _mm3(["backends", "--device", "cpu"], site, tmp_path)
    assert _row(r.stdout, BACKEND) is None
    assert f"{BACKEND} from {DIST} {VERSION} [disabled]: excluded by MM3_DISABLE_PLUGINS" in r.stdout


def test_mm3_check_passes(site: Path, tmp_path: Path) -> None:
    r = _mm3(["check", BACKEND, "--device", "cpu"], site, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"backend {BACKEND!r} on cpu ({DIST} {VERSION})" in r.stdout
    assert "PASSED:" in r.stdout and " 0 failed" in r.stdout
    passed = [line for line in r.stdout.splitlines() if "] PASS " in line]
    # Every attention case ran (the quick plan takes the dtypes in turn); only the indexer/composed cases are skipped.
    assert any("attention/mixed_h2_g2:" in line for line in passed), r.stdout
    assert any("buffer/attention_reads_other_layout_h2" in line for line in passed), r.stdout
    assert "does not provide ['index_topk']" in r.stdout


def test_pytest_conformance_and_the_examples_own_tests(site: Path, tmp_path: Path) -> None:
    """Both pytest routes a vendor would use: mm3's suite by name, and its own tests with mm3's fixtures."""
    # `mm3 check` above ran the whole suite; two cases are enough to show the pytest route works.
    r = _run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--pyargs",
              "mm3.testing.conformance", "--mm3-backend", BACKEND, "--mm3-dtype", "float32",
              "-k", "mixed_h2_g2 or attention_reads_other_layout_h2"], site, tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert f"mm3 conformance: backend(s) {BACKEND} on cpu" in r.stdout
    assert "2 passed" in r.stdout and f"[{BACKEND}:attention/mixed_h2_g2:float32] PASSED" in r.stdout, r.stdout

    tests = shutil.copytree(EXAMPLE / "tests", tmp_path / "example_tests")
    r = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
              "-k", "not conformance"], site, tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    summary = r.stdout.strip().splitlines()[-1]
    assert " passed" in summary and not any(w in summary for w in ("failed", "skipped", "error")), summary
