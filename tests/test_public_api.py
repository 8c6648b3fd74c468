"""Two public faces, one per audience, each documented by examples that run.

``mm3`` is the engine's: the layer, what a step is made of, the scoped backend
choice, the tensor-parallel layer and the errors. ``mm3.plugin`` is the backend
author's. Everything else is internal and lives where it is defined; the names
``mm3`` exported before still resolve, with a warning that says where they went.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import json
import warnings

import pytest

import mm3
import mm3.plugin

ENGINE = ["SparseAttention", "SparseAttentionParams", "BatchMetadata", "PagedKVCache", "TopkBuffer",
          "use_backend", "TensorParallelSparseAttention",
          "MM3Error", "InputError", "ConfigError", "UnknownBackendError", "BackendUnavailableError",
          "NoBackendError", "PluginError", "ContractViolation", "__version__"]
PLUGIN = ["hookimpl", "BackendCapabilities", "Probe", "TopkBuffer", "PagedKVCache", "BatchMetadata",
          "SparseAttentionParams", "TokenSlots", "key_rows", "InputError", "BackendUnavailableError"]

# Exported objects defined in files another change owns; their examples come with that change.
EXAMPLE_PENDING: set[str] = set()


def test_the_engine_face_is_the_engines_api() -> None:
    assert mm3.__all__ == ENGINE
    assert not [n for n in dir(mm3) if not n.startswith("_") and n not in ENGINE and
                not inspect.ismodule(getattr(mm3, n))], "a public name outside __all__"


def test_the_plugin_face_is_what_a_backend_imports() -> None:
    assert mm3.plugin.__all__ == PLUGIN
    assert "Example" in (mm3.plugin.__doc__ or "") and "entry-point" in mm3.plugin.__doc__


def _objects() -> list[tuple[str, object]]:
    seen: dict[int, tuple[str, object]] = {}
    for module in (mm3, mm3.plugin):
        for name in module.__all__:
            if name != "__version__":
                obj = getattr(module, name)
                seen.setdefault(id(obj), (name, obj))
    return sorted(seen.values(), key=lambda item: item[0])


@pytest.mark.parametrize("name, obj", _objects(), ids=[n for n, _ in _objects()])
def test_every_exported_object_has_an_example_that_runs(name: str, obj: object, request: pytest.FixtureRequest
                                                          ) -> None:
    if name in EXAMPLE_PENDING:
        request.applymarker(pytest.mark.xfail(strict=True, reason="its file's owner adds the example"))
    home = vars(importlib.import_module(getattr(obj, "__module__", None) or type(obj).__module__))
    tests = [t for t in doctest.DocTestFinder(recurse=False).find(obj, name, globs=dict(home)) if t.examples]
    assert tests, f"{name}'s docstring has no >>> example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for t in tests:
        runner.run(t)
    assert not runner.failures, f"{name}'s example fails"


@pytest.mark.parametrize("name, home", [("Settings", "mm3.runtime.config"), ("Registry", "mm3.runtime.registry"),
                                        ("hookimpl", "mm3.plugin"), ("select", "mm3.runtime.selection"),
                                        ("shard_params", "mm3.runtime.distributed")])
def test_a_moved_name_still_resolves_and_says_where_it_lives(name: str, home: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"mm3.{name} moved: import it from {home}"):
        obj = getattr(mm3, name)
    assert obj is getattr(importlib.import_module(home), name)
    with pytest.raises(AttributeError, match="no attribute 'Setings'"):
        mm3.Setings  # noqa: B018


def test_every_capability_is_described_where_users_look(capsys: pytest.CaptureFixture[str]) -> None:
    """Each BackendCapabilities field's description: in the model, in `mm3 backends --json`, in spec.md §7."""
    from pathlib import Path

    from mm3.cli import main

    fields = mm3.plugin.BackendCapabilities.model_fields
    assert all(f.description for f in fields.values()), [n for n, f in fields.items() if not f.description]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["backends", "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["capability_fields"] == {n: f.description for n, f in fields.items()}
    assert set(data["backends"][0]["capabilities"]) == set(fields)
    spec = (Path(__file__).resolve().parents[1] / "docs" / "spec.md").read_text()
    for n, f in fields.items():
        assert f"| `{n}` |" in spec and f" | {f.description} |" in spec, f"docs/spec.md §7 lacks {n}: {f.description}"
