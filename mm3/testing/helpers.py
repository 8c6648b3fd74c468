"""The plain helpers behind mm3's pytest fixtures: usable in a script, a notebook or any test runner.

Nothing here imports pytest: a plugin author can try a backend right after
``pip install mm3`` (docs/plugins.md), and :mod:`mm3.testing.fixtures` wraps
these in fixtures for pytest users.

Example (an isolated registry and a random mixed step, then the layer on them):
    >>> import torch, mm3
    >>> registry = RegistryFactory()(installed_plugin("cpu_ref"))   # exactly these plugins, nothing else
    >>> params = default_params()
    >>> case = CaseFactory(seed=0)(params)
    >>> layer = mm3.SparseAttention(params, dtype=torch.float32, max_num_tokens=64, registry=registry)
    >>> layer(case.q, case.index_q, case.caches, case.batch).shape
    torch.Size([33, 8, 32])
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence, Union

if TYPE_CHECKING:
    import pytest
    import torch

    from mm3.contract.batch import BatchMetadata
    from mm3.contract.buffers import PagedKVCache
    from mm3.contract.params import SparseAttentionParams
    from mm3.runtime.registry import Registry
    from mm3.testing.factories import Case

__all__ = ["RegistryFactory", "CaseFactory", "installed_plugin", "write_distribution", "default_params",
           "DEFAULT_DECODES", "DEFAULT_PREFILLS"]


DEFAULT_DECODES: tuple[int, ...] = (70, 33, 150)
"""Decode ``seq_len``s of the default step: contexts of 3, 2 and 10 blocks of 16 (topk 4)."""

DEFAULT_PREFILLS: tuple[tuple[int, int], ...] = ((9, 40), (20, 20))
"""``(query_len, seq_len)`` of the default prefills: one chunked (context 31), one fresh."""


def default_params(**overrides: Any) -> "SparseAttentionParams":
    """Small shapes with M3's structure: 8 query heads, 2 KV/index heads, D = Di = 32, B = 16, top-4.

    Example:
        >>> default_params(topk=2).gqa_group
        4
    """
    from mm3.contract.params import SparseAttentionParams

    base: dict[str, Any] = dict(num_heads=8, num_kv_heads=2, head_dim=32, num_index_heads=2,
                                index_head_dim=32, block_size=16, topk=4)
    base.update(overrides)
    return SparseAttentionParams(**base)


def installed_plugin(name: str) -> object:
    """The plugin object of the installed ``mm3.backends`` entry point ``name`` (e.g. ``"cpu_ref"``).

    Example:
        >>> from mm3.runtime.registry import Registry
        >>> Registry([installed_plugin("cpu_ref")], entry_points=False).names()
        ['cpu_ref']
    """
    from mm3.contract.errors import UnknownBackendError
    from mm3.runtime.discovery import ENTRY_POINT_GROUP, list_entry_points

    eps = list(list_entry_points(ENTRY_POINT_GROUP))
    for ep in eps:
        if ep.name == name:
            return ep.load()
    raise UnknownBackendError(
        f"no installed {ENTRY_POINT_GROUP!r} entry point named {name!r} (installed: "
        f"{sorted(ep.name for ep in eps) or 'none'}); install the distribution that provides it, "
        f"or pass the plugin module itself")


class RegistryFactory:
    """Builds isolated registries: exactly the plugins given, never an installed entry point.

    Args:
        monkeypatch: when given, ``default=True`` registries become the process-wide
            default (``default_registry()``) until the monkeypatch is undone.

    Example:
        >>> from mm3.testing.mock import MockBackend
        >>> reg = RegistryFactory()(MockBackend("m1"), installed=["cpu_ref"], default=False)
        >>> reg.names()
        ['cpu_ref', 'm1']
    """

    def __init__(self, monkeypatch: Optional["pytest.MonkeyPatch"] = None) -> None:
        self._monkeypatch = monkeypatch
        self.created: list["Registry"] = []

    def __call__(self, *plugins: object, installed: Iterable[str] = (), settings: Any = None,
                 default: Optional[bool] = None) -> "Registry":
        """A loaded :class:`~mm3.runtime.registry.Registry` of ``plugins`` plus the ``installed`` entry points.

        ``plugins`` are modules or objects with ``@hookimpl`` functions (a
        :class:`~mm3.testing.mock.MockBackend`, your plugin module...), or
        ``"pkg.module"`` import paths. ``installed`` names entry points (``"cpu_ref"``)
        loaded explicitly, so nothing else that happens to be installed leaks in.
        ``default`` (default: True inside the fixture) makes it ``default_registry()``.
        Broken plugins are reported in ``registry.problems()``, as in production.
        """
        import mm3.runtime.registry as registry_module

        reg = registry_module.Registry([*plugins, *(installed_plugin(n) for n in installed)],
                                       entry_points=False, settings=settings)
        reg.backends()  # load now, so a warning for a broken plugin points at this call
        if default is None:
            default = self._monkeypatch is not None
        if default:
            if self._monkeypatch is None:
                raise RuntimeError("RegistryFactory(default=True) needs a monkeypatch to undo it; use the "
                                   "mm3_registry fixture, or pass default=False")
            self._monkeypatch.setattr(registry_module, "_default", reg)
        self.created.append(reg)
        return reg

    @staticmethod
    def installed(name: str) -> object:
        """Same as :func:`installed_plugin`."""
        return installed_plugin(name)


class CaseFactory:
    """Random decode-first steps with sensible defaults (see :func:`mm3.testing.factories.make_case`).

    The default step has 3 decodes, 1 padding decode (between real ones), a
    chunked prefill and a fresh prefill: T = 33 tokens, not a multiple of 4,
    fp32 attention with a bf16 index cache.

    Example:
        >>> case = CaseFactory(seed=1)()
        >>> case.batch.num_tokens, case.batch.num_decodes, case.q.dtype
        (33, 4, torch.float32)
    """

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._calls = 0

    def _next_seed(self, seed: Optional[int]) -> int:
        if seed is not None:
            return seed
        self._calls += 1
        return (self._seed + 7919 * self._calls) & 0x7FFFFFFF

    def __call__(self, params: Optional["SparseAttentionParams"] = None, *,
                 decodes: Sequence[int] = DEFAULT_DECODES,
                 prefills: Sequence[tuple[int, int]] = DEFAULT_PREFILLS, decode_query_len: int = 1,
                 padding_decodes: int = 1, empty_decodes: int = 0,
                 dtype: Union[str, "torch.dtype"] = "float32",
                 index_dtype: Union[str, "torch.dtype"] = "bfloat16", kv_layout: str = "NHD",
                 device: Union[str, "torch.device"] = "cpu", seed: Optional[int] = None) -> "Case":
        """A :class:`~mm3.testing.factories.Case`; every argument as in ``make_case``."""
        from mm3.testing.factories import make_case

        return make_case(params if params is not None else default_params(), decodes=decodes,
                         prefills=prefills, decode_query_len=decode_query_len,
                         padding_decodes=padding_decodes, empty_decodes=empty_decodes, dtype=dtype,
                         index_dtype=index_dtype, kv_layout=kv_layout, device=device,
                         seed=self._next_seed(seed))

    def batch(self, *, block_size: int = 16, decodes: Sequence[int] = DEFAULT_DECODES,
              prefills: Sequence[tuple[int, int]] = DEFAULT_PREFILLS, decode_query_len: int = 1,
              padding_decodes: int = 1, empty_decodes: int = 0,
              device: Union[str, "torch.device"] = "cpu", seed: Optional[int] = None) -> "BatchMetadata":
        """Only the batch metadata of such a step (pages in random order, spare pages)."""
        tiny = default_params(num_heads=1, num_kv_heads=1, num_index_heads=1, head_dim=8,
                              index_head_dim=8, block_size=block_size, topk=1)
        return self(tiny, decodes=decodes, prefills=prefills, decode_query_len=decode_query_len,
                    padding_decodes=padding_decodes, empty_decodes=empty_decodes, device=device,
                    seed=seed).batch

    def caches(self, params: Optional["SparseAttentionParams"] = None, num_pages: int = 16, *,
               dtype: Union[str, "torch.dtype"] = "float32",
               index_dtype: Union[str, "torch.dtype"] = "bfloat16", kv_layout: str = "NHD",
               device: Union[str, "torch.device"] = "cpu", seed: Optional[int] = None) -> "PagedKVCache":
        """Paged caches filled with N(0, 1) values."""
        import torch

        from mm3.contract.buffers import TORCH_DTYPES
        from mm3.testing.factories import random_caches

        def dt(d: Union[str, torch.dtype]) -> torch.dtype:
            return TORCH_DTYPES[d] if isinstance(d, str) else d

        g = torch.Generator().manual_seed(self._next_seed(seed))
        return random_caches(params if params is not None else default_params(), num_pages,
                             dtype=dt(dtype), index_dtype=dt(index_dtype), kv_layout=kv_layout,
                             device=device, generator=g)


_DIST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")


def write_distribution(site: Union[str, Path], name: str, version: str = "0.1.0", *,
                       entry_points: Optional[Mapping[str, Mapping[str, str]]] = None,
                       files: Optional[Mapping[str, str]] = None) -> Path:
    """Install a distribution's *metadata* (and optional source files) into directory ``site``.

    A ``NAME-VERSION.dist-info`` folder holding ``METADATA`` and
    ``entry_points.txt`` on a ``sys.path`` entry is what ``pip install`` leaves
    behind for ``importlib.metadata``, so with ``site`` on ``PYTHONPATH`` the
    entry points are discovered exactly like a real install. Use it to test
    entry-point registration without building a wheel.

    Args:
        site: directory to write into (created); put it on ``sys.path``/``PYTHONPATH``.
        name, version: the distribution's name and version (shown by ``mm3 backends``).
        entry_points: ``{group: {entry point name: "module:attr" or "module"}}``.
        files: ``{relative path: source text}`` written under ``site`` (your plugin modules).

    Returns:
        ``site`` as a :class:`~pathlib.Path`.

    Example:
        >>> import tempfile
        >>> site = write_distribution(tempfile.mkdtemp(), "acme-attn", "1.2.0",
        ...     entry_points={"mm3.backends": {"acme": "acme_plugin"}},
        ...     files={"acme_plugin.py": "raise ImportError('acme_ext missing')"})
        >>> sorted(p.name for p in site.iterdir())
        ['acme_attn-1.2.0.dist-info', 'acme_plugin.py']
    """
    if not _DIST_NAME.match(name):
        raise ValueError(f"invalid distribution name {name!r}: letters, digits, '.', '-', '_'")
    site = Path(site)
    site.mkdir(parents=True, exist_ok=True)
    for rel, text in (files or {}).items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    # Wheel naming: the dist-info folder uses the name with runs of -_. folded to "_".
    info = site / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines: list[str] = []
    for group, eps in (entry_points or {}).items():
        lines.append(f"[{group}]")
        lines += [f"{ep} = {target}" for ep, target in eps.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    return site
