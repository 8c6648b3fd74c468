"""mm3's pytest fixtures (the plain helpers they wrap are in :mod:`mm3.testing.helpers`).

They exist in a pytest run that asks for mm3's plugin: ``pytest -p mm3``,
``addopts = "-p mm3"`` in your pytest configuration, or
``pytest_plugins = ["mm3.testing.pytest_plugin"]`` in a ``conftest.py``
(see :mod:`mm3.testing.pytest_plugin`).

=====================  ===========================================================================
fixture                what it gives
=====================  ===========================================================================
``mm3_registry``       factory ``mm3_registry(*plugins, installed=(), default=True) -> Registry``:
                       an isolated registry of exactly these plugins (no entry point leaks in),
                       made the process default for the test so code that calls
                       ``default_registry()`` (``SparseAttention``, the CLI) sees it
``mock_backend``       factory ``mock_backend(name="mock", **capabilities) -> MockBackend``
``mm3_params``         small realistic :class:`~mm3.SparseAttentionParams` (8 query / 2 KV heads)
``mm3_case``           factory of random mixed steps (decodes, padding, chunked prefill):
                       ``mm3_case(params=None, **make_case_kwargs) -> Case``
``mm3_batch``          factory of :class:`~mm3.BatchMetadata` only
``mm3_caches``         factory of random :class:`~mm3.PagedKVCache`
``mm3_clean_env``      no ``MM3_*`` variables, cwd in a temp dir (no ``mm3.toml`` applies),
                       a fresh default registry before and after the test
``mm3_conformance``    ``mm3_conformance(backend, **run_conformance_kwargs)`` runs the
                       conformance suite and fails the test with the per-case report
=====================  ===========================================================================

Random inputs are seeded from the test's node id, so a failure reproduces.

Example (a plugin author's test file)::

    import my_backend.plugin as plugin

    def test_attention_matches_reference(mm3_registry, mm3_case):
        reg = mm3_registry(plugin, installed=["cpu_ref"])
        case = mm3_case()
        ...

    def test_conforms(mm3_registry, mm3_conformance):
        mm3_conformance(mm3_registry(plugin).get("mine"), dtypes=["float32"])
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Union

import pytest

from mm3.testing.helpers import CaseFactory, RegistryFactory, default_params

if TYPE_CHECKING:
    from mm3.contract.batch import BatchMetadata
    from mm3.contract.buffers import PagedKVCache
    from mm3.contract.params import SparseAttentionParams
    from mm3.runtime.backend import Backend
    from mm3.testing.conformance import ConformanceReport
    from mm3.testing.mock import MockBackend

__all__ = ["mm3_registry", "mock_backend", "mm3_params", "mm3_case", "mm3_batch", "mm3_caches",
           "mm3_clean_env", "mm3_conformance"]


def _node_seed(request: pytest.FixtureRequest) -> int:
    return zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF


# -- fixtures -----------------------------------------------------------------------------------

@pytest.fixture
def mm3_registry(monkeypatch: pytest.MonkeyPatch) -> RegistryFactory:
    """Factory of isolated registries; the latest one is ``default_registry()`` during the test.

    Example::

        def test_mine(mm3_registry, mock_backend):
            reg = mm3_registry(mock_backend("fast", priority=5), installed=["cpu_ref"])
            assert reg.names() == ["fast", "cpu_ref"]
    """
    return RegistryFactory(monkeypatch)


@pytest.fixture
def mock_backend() -> Callable[..., "MockBackend"]:
    """Factory of :class:`~mm3.testing.mock.MockBackend` (same arguments).

    Example::

        def test_layout(mm3_registry, mock_backend):
            mock = mock_backend("tm", topk_layout="token_major", topk_requires_contiguous=True)
            reg = mm3_registry(mock, installed=["cpu_ref"])
    """
    from mm3.testing.mock import MockBackend

    def make(name: str = "mock", **kwargs: Any) -> MockBackend:
        return MockBackend(name, **kwargs)

    return make


@pytest.fixture
def mm3_params() -> "SparseAttentionParams":
    """:func:`default_params`: 8 query heads, 2 KV/index heads, D = Di = 32, blocks of 16, top-4."""
    return default_params()


@pytest.fixture
def mm3_case(request: pytest.FixtureRequest) -> CaseFactory:
    """Factory of random mixed steps, seeded from the test id (see :class:`CaseFactory`)."""
    return CaseFactory(_node_seed(request))


@pytest.fixture
def mm3_batch(request: pytest.FixtureRequest) -> Callable[..., "BatchMetadata"]:
    """Factory of batch metadata only (see :meth:`CaseFactory.batch`)."""
    return CaseFactory(_node_seed(request)).batch


@pytest.fixture
def mm3_caches(request: pytest.FixtureRequest) -> Callable[..., "PagedKVCache"]:
    """Factory of random paged caches (see :meth:`CaseFactory.caches`)."""
    return CaseFactory(_node_seed(request)).caches


@pytest.fixture
def mm3_clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """No ``MM3_*`` settings from the environment, no config file, a fresh default registry.

    Yields the temporary working directory (write an ``mm3.toml`` there to test
    file configuration). Variables of the test/bench namespaces
    (``MM3_TEST_*``...) are kept.
    """
    from mm3.runtime.config import RESERVED_ENV_PREFIXES
    from mm3.runtime.registry import reset_default_registry

    for key in list(os.environ):
        if key.upper().startswith("MM3_") and not key.upper().startswith(RESERVED_ENV_PREFIXES):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    reset_default_registry()
    yield tmp_path
    reset_default_registry()


@pytest.fixture
def mm3_conformance() -> Callable[..., "ConformanceReport"]:
    """``mm3_conformance(backend, **kwargs)``: run the suite, fail the test with the report on failure.

    ``backend`` is a :class:`~mm3.runtime.backend.Backend` or a name in the default
    registry; ``kwargs`` go to :func:`mm3.testing.conformance.run_conformance`
    (``device``, ``quick``, ``dtypes``, ``index_dtypes``...). Returns the report.
    """
    from mm3.testing.conformance import run_conformance

    def check(backend: Union["Backend", str], **kwargs: Any) -> "ConformanceReport":
        report = run_conformance(backend, **kwargs)
        if not report.passed:
            pytest.fail(report.format(show_skipped=False), pytrace=False)
        return report

    return check
