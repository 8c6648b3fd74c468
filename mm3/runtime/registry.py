"""The registry: every valid backend, discovered once, with the problems of the rest.

Built-ins and third-party packages register through the entry-point group
``mm3.backends`` (:mod:`mm3.runtime.discovery`); tests build isolated
registries from explicit plugins. A valid plugin becomes a bound
:class:`~mm3.runtime.backend.Backend`.

Example:
    >>> from mm3.testing.mock import MockBackend
    >>> reg = Registry(plugins=[MockBackend("mine", ops={"attention"})], entry_points=False)
    >>> be = reg.get("mine")
    >>> be.provides("attention"), be.provides("index_topk"), be.probe("cpu").available
    (True, False, True)

Behaviour (what excludes a plugin: :mod:`mm3.runtime.discovery`):

* **Lazy, once, thread-safe.** Nothing is imported until the first question
  (``backends()``, ``get()``, ``problems()``, ...); the first caller loads under
  a lock, later callers reuse the result.
* **Duplicate names.** When two plugins loaded together declare the same
  backend name, *both* are excluded (picking one would depend on install
  order) and ``get(name)`` raises :class:`~mm3.errors.PluginError` naming both
  sources. An explicit :meth:`Registry.register` of a taken name raises that
  error at once and leaves the registry unchanged.
"""

from __future__ import annotations

import difflib
import importlib
import sys
import threading
import traceback
import warnings
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import pluggy

import mm3.contract.hookspecs as _hookspecs
from mm3.contract.errors import PluginError, UnknownBackendError
from mm3.contract.hookspecs import PROJECT
from mm3.runtime import discovery
from mm3.runtime.backend import Backend
from mm3.runtime.config import default_settings, reset_default_settings
from mm3.runtime.discovery import (
    ENTRY_POINT_GROUP, Candidate, PluginLoadWarning, PluginProblem, PluginSource, entry_point_source,
    exc_line, exclusion, plugin_label, validate_plugin,
)

__all__ = ["Registry", "default_registry", "reset_default_registry"]


class Registry:
    """The set of backends: discovered, validated, bound, diagnosable.

    Args:
        plugins: plugins (modules or objects with ``@hookimpl`` functions, or
            ``"pkg.module"`` import paths) registered as ``explicit``.
        entry_points: also load the ``mm3.backends`` entry points (default).
            ``Registry(plugins=[...], entry_points=False)`` is fully isolated.
        settings: an :class:`mm3.runtime.config.Settings` (or any object with
            ``plugins``, ``disable_plugins`` and ``no_plugin_autoload``) for the
            allow/deny lists; default :func:`~mm3.runtime.config.default_settings` at load time.

    Example:
        >>> from mm3.testing.mock import MockBackend
        >>> reg = Registry(plugins=[MockBackend("fake"), MockBackend("fast", priority=5)],
        ...                entry_points=False)
        >>> reg.names()                                   # highest priority first
        ['fast', 'fake']
    """

    def __init__(self, plugins: Iterable[object] = (), *, entry_points: bool = True,
                 settings: Optional[Any] = None) -> None:
        self._initial = list(plugins)
        self._use_entry_points = entry_points
        self._settings = settings
        self._lock = threading.RLock()
        self._loaded = False
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(_hookspecs)
        self._backends: dict[str, Backend] = {}
        self._problems: list[PluginProblem] = []
        # backend name -> sources of the plugins excluded for sharing it
        self._duplicates: dict[str, list[PluginSource]] = {}
        self._counter = 0

    # -- public API -----------------------------------------------------------------
    @property
    def plugin_manager(self) -> pluggy.PluginManager:
        """The underlying pluggy manager (for introspection; never needed to dispatch)."""
        return self._pm

    def backends(self) -> list[Backend]:
        """Valid backends, highest priority first, then by name."""
        self._ensure_loaded()
        with self._lock:
            return sorted(self._backends.values(), key=lambda b: (-b.priority, b.name))

    def names(self) -> list[str]:
        """Backend names in :meth:`backends` order."""
        return [b.name for b in self.backends()]

    def problems(self) -> list[PluginProblem]:
        """Every excluded plugin (disabled, broken or duplicate), in discovery order."""
        self._ensure_loaded()
        with self._lock:
            return list(self._problems)

    def get(self, name: str, *, origin: Optional[str] = None) -> Backend:
        """The backend called ``name``; ``origin`` says where the name came from, for the error.

        Raises:
            PluginError: ``name`` was declared by several plugins (all excluded).
            UnknownBackendError: no valid backend has that name; the message lists
                the known names and any excluded plugin of that name.
        """
        self._ensure_loaded()
        with self._lock:
            be = self._backends.get(name)
            if be is not None:
                return be
            if name in self._duplicates:
                raise PluginError(self._duplicate_message(name, self._duplicates[name]))
            known = sorted(self._backends)
            related = [p for p in self._problems if name in (p.name, p.backend)]
        where = f" ({origin})" if origin else ""
        msg = f"unknown backend {name!r}{where}; known backends: {', '.join(known) or '(none)'}"
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            msg += f" (did you mean {close[0]!r}?)"
        if related:
            msg += "; a plugin of that name was excluded: " + "; ".join(str(p) for p in related)
        else:
            msg += "; run `mm3 backends` to see installed plugins and their problems"
        raise UnknownBackendError(msg)

    def __contains__(self, name: object) -> bool:
        self._ensure_loaded()
        with self._lock:
            return name in self._backends

    def __iter__(self) -> Iterator[Backend]:
        return iter(self.backends())

    def __len__(self) -> int:
        self._ensure_loaded()
        with self._lock:
            return len(self._backends)

    def register(self, plugin: object, source: Optional[PluginSource] = None) -> Backend:
        """Register one plugin now and return its :class:`Backend`.

        Unlike loading, this raises on any problem (the caller asked for this
        plugin): :class:`~mm3.contract.errors.PluginError` for an invalid plugin or a
        backend name that is already taken; the registry is left unchanged.

        Example:
            >>> from mm3.testing.mock import MockBackend
            >>> reg = Registry(entry_points=False)
            >>> reg.register(MockBackend("mine")).name
            'mine'
            >>> reg.register(MockBackend("mine"))           # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            mm3.contract.errors.PluginError: backend name 'mine' is declared by more than one plugin: ...
        """
        self._ensure_loaded()
        with self._lock:
            cand = self._validate(plugin, source or self._explicit_source(plugin),
                                  name_hint=None)
            if isinstance(cand, PluginProblem):
                raise PluginError(f"cannot register {cand.source}: [{cand.stage}] {cand.error}")
            taken = self._backends.get(cand.name)
            if taken is not None or cand.name in self._duplicates:
                self._pm.unregister(name=cand.pm_name)
                others = [taken.source] if taken is not None else self._duplicates[cand.name]
                raise PluginError(self._duplicate_message(cand.name, [*others, cand.source]))
            be = Backend(cand.plugin, cand.capabilities, cand.source, cand.impls)
            self._backends[cand.name] = be
            return be

    # -- loading ------------------------------------------------------------------------
    def _ensure_loaded(self) -> None:
        if self._loaded:  # fast path, no lock once loaded
            return
        with self._lock:
            if self._loaded:
                return
            try:
                self._load()
            finally:
                # Even a crash inside loading must not make every later call retry
                # (and re-warn); what was gathered stays.
                self._loaded = True

    def _load(self) -> None:
        candidates: list[Candidate] = []
        for plugin in self._initial:
            src = self._explicit_source(plugin)
            if isinstance(plugin, str):
                try:
                    plugin = importlib.import_module(plugin)
                except Exception as e:
                    self._report(PluginProblem(src.value or str(plugin), src, "import", exc_line(e),
                                               details=traceback.format_exc()))
                    continue
            self._add_candidate(candidates, self._validate(plugin, src, name_hint=None))
        if self._use_entry_points:
            self._load_entry_points(candidates)
        self._resolve_duplicates(candidates)

    def _load_entry_points(self, candidates: list[Candidate]) -> None:
        settings = self._settings if self._settings is not None else default_settings()
        allow = set(settings.plugins) if settings.plugins is not None else None
        # The deny list is pluggy's own: a blocked name (entry point, distribution or
        # backend) is never imported or registered.
        for name in settings.disable_plugins or ():
            self._pm.set_blocked(name)

        seen_names: set[str] = set()
        for ep in discovery.list_entry_points(ENTRY_POINT_GROUP):
            src = entry_point_source(ep)
            seen_names |= {ep.name} | ({src.distribution} if src.distribution else set())
            reason = exclusion(ep.name, src, settings, self._pm.is_blocked)
            if reason:
                self._problems.append(PluginProblem(ep.name, src, "disabled", reason))
                continue
            try:
                plugin = ep.load()
            except BaseException as e:  # noqa: BLE001 - a plugin's import may even sys.exit
                if isinstance(e, KeyboardInterrupt):
                    raise
                self._report(PluginProblem(
                    ep.name, src, "import",
                    f"{exc_line(e)} (while importing {src.value}; fix or uninstall "
                    f"{src.dist_label}, or set MM3_DISABLE_PLUGINS={ep.name})",
                    details=traceback.format_exc()))
                continue
            got = self._validate(plugin, src, name_hint=ep.name)
            if isinstance(got, Candidate) and self._pm.is_blocked(got.name):
                # Denied by backend name (the entry point is named differently).
                self._pm.unregister(name=got.pm_name)
                self._problems.append(PluginProblem(
                    ep.name, src, "disabled",
                    f"backend {got.name!r} excluded by MM3_DISABLE_PLUGINS (disable_plugins="
                    f"{sorted(settings.disable_plugins)}); remove {got.name!r} from it to load",
                    backend=got.name))
                continue
            self._add_candidate(candidates, got)
        if allow:
            for missing in sorted(allow - seen_names):
                self._problems.append(PluginProblem(
                    missing, PluginSource(entry_point=missing), "not_found",
                    f"MM3_PLUGINS names {missing!r} but no {ENTRY_POINT_GROUP!r} entry point or "
                    f"distribution has that name; installed: {sorted(seen_names) or '(none)'}"))

    def _add_candidate(self, out: list[Candidate], got: Union[Candidate, PluginProblem]) -> None:
        if isinstance(got, PluginProblem):
            self._report(got)
        else:
            out.append(got)

    def _resolve_duplicates(self, candidates: list[Candidate]) -> None:
        by_name: dict[str, list[Candidate]] = {}
        for c in candidates:
            by_name.setdefault(c.name, []).append(c)
        for name, group in by_name.items():
            if len(group) > 1:
                sources = [c.source for c in group]
                self._duplicates[name] = sources
                msg = self._duplicate_message(name, sources)
                for c in group:
                    self._pm.unregister(name=c.pm_name)
                    self._report(PluginProblem(c.source.entry_point if not c.source.is_explicit
                                               else name, c.source, "duplicate", msg, backend=name))
                continue
            c = group[0]
            self._backends[name] = Backend(c.plugin, c.capabilities, c.source, c.impls)

    def _duplicate_message(self, name: str, sources: Sequence[PluginSource]) -> str:
        listed = " and ".join(str(s) for s in sources)
        return (f"backend name {name!r} is declared by more than one plugin: {listed}; "
                f"uninstall one of them or disable one with MM3_DISABLE_PLUGINS=<entry point name>")

    def _report(self, problem: PluginProblem) -> None:
        self._problems.append(problem)
        # Point the warning at the caller's code, not at registry internals.
        level, frame = 1, sys._getframe(0)
        while frame is not None and frame.f_code.co_filename == __file__:
            level, frame = level + 1, frame.f_back
        warnings.warn(f"mm3: plugin excluded: {problem}", PluginLoadWarning, stacklevel=level)

    def _explicit_source(self, plugin: object) -> PluginSource:
        value = plugin if isinstance(plugin, str) else plugin_label(plugin)
        return PluginSource(entry_point="explicit", value=value)

    # -- validation -----------------------------------------------------------------------
    def _validate(self, plugin: object, source: PluginSource,
                  name_hint: Optional[str]) -> Union[Candidate, PluginProblem]:
        """Register ``plugin`` in the plugin manager and check it; unregister it on failure."""
        label = name_hint or source.value or plugin_label(plugin)
        self._counter += 1
        # A unique pluggy name per plugin: two entry points may point at one module
        # name in different distributions, and pluggy names must be unique.
        return validate_plugin(self._pm, plugin, source, label, f"{label}#{self._counter}")


# -- the process-wide registry ----------------------------------------------------------------

_default: Optional[Registry] = None
_default_lock = threading.Lock()


def default_registry() -> Registry:
    """The process-wide registry (entry points + Settings from env/files); created once.

    Example:
        >>> "cpu_ref" in default_registry().names()
        True
    """
    global _default
    reg = _default
    if reg is None:
        with _default_lock:
            if _default is None:
                _default = Registry()
            reg = _default
    return reg


def reset_default_registry() -> None:
    """Forget the process-wide registry and settings; the next :func:`default_registry` loads afresh.

    Use after changing ``MM3_*`` settings or installing a plugin in-process.
    """
    global _default
    with _default_lock:
        _default = None
    reset_default_settings()
