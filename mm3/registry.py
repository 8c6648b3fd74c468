"""Discover, validate and bind backends: the registry.

A backend is a pluggy plugin (a module or an object with ``@mm3.hookimpl``
functions, see :mod:`mm3.contract.hookspecs`). Built-ins and third-party packages both
register through the entry-point group ``mm3.backends``; tests build isolated
registries from explicit plugins.

Example:
    >>> from mm3.registry import Registry
    >>> reg = Registry(plugins=[my_plugin_module], entry_points=False)  # doctest: +SKIP
    >>> be = reg.get("mine")                                             # doctest: +SKIP
    >>> be.provides("attention"), be.probe("cpu").available             # doctest: +SKIP
    (True, True)
    >>> be.attention_forward(q, caches, topk, batch, params, out)        # doctest: +SKIP

Behaviour (DESIGN §5):

* **Lazy, once, thread-safe.** Nothing is imported until the first question
  (``backends()``, ``get()``, ``problems()``, ...); the first caller loads under
  a lock, later callers reuse the result.
* **Never fatal.** A plugin that fails to import, has a hookimpl whose
  arguments do not match the spec, implements a hook name that is not in the
  spec, declares invalid capabilities, declares an op without implementing its
  hook, or shares its backend name with another plugin is *excluded*: it is
  recorded as a :class:`PluginProblem` (with its distribution and the error),
  a :class:`PluginLoadWarning` is issued, and every other plugin keeps working.
* **Duplicate names.** When two plugins loaded together declare the same
  backend name, *both* are excluded (picking one would depend on install
  order) and ``get(name)`` raises :class:`~mm3.contract.errors.PluginError` naming both
  sources. An explicit :meth:`Registry.register` of a taken name raises that
  error at once and leaves the registry unchanged.
* **Allow/deny lists** (``Settings.plugins``, ``Settings.disable_plugins``,
  ``Settings.no_plugin_autoload``) apply to entry points only; explicitly
  passed plugins are always registered. Excluded entry points are not imported
  and appear in :meth:`Registry.problems` with stage ``"disabled"`` and the
  setting that excluded them (no warning: that was a request, not a fault).

  - ``plugins`` (``MM3_PLUGINS``): when set, only entry points whose name (or
    distribution name) is listed load.
  - ``disable_plugins`` (``MM3_DISABLE_PLUGINS``): entry points whose name or
    distribution name is listed are skipped; a loaded plugin whose *backend*
    name is listed is dropped too.
  - ``no_plugin_autoload`` (``MM3_NO_PLUGIN_AUTOLOAD``): third-party entry
    points (distributions other than ``mm3``) load only when named in
    ``plugins``; mm3's own built-ins still load so the library stays usable.

* **Bound dispatch.** pluggy is used to declare and validate the contract, not
  to dispatch. A :class:`Backend` holds the plugin's own hookimpl functions,
  resolved once, so ``backend.index_topk(...)`` is a plain Python call: hooks
  of different backends can never mix and a forward pays no ``pm.hook`` cost.

Dispatch overhead, measured in the development container (x86-64, CPython
3.11, pluggy 1.6; a trivial hookimpl that returns None; median of 7 x 200k
calls, the cost of an empty lambda subtracted; six runs)::

    $ python -c "from mm3.registry import _measure_dispatch as m; print(m())"
    {'pm.hook': 1.26, 'bound': 0.039}     # microseconds per call (typical run)

    pm.hook.index_topk(index_q=..., ...)   1.18 - 1.37 us / call
    backend.index_topk(...)                0.04 - 0.06 us / call (one outlier 0.10)

A bound call costs about 1/20-1/30 of a ``pm.hook`` call (it is exactly one
call of the plugin's function; the remaining cost is Python's call overhead).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import sys
import threading
import traceback
import types
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal, Optional, Sequence, Union

import pluggy
import torch
from pydantic import ValidationError

import mm3.contract.hookspecs as _hookspecs
from mm3.contract.buffers import TopkBuffer
from mm3.contract.capabilities import ALL_OPS, BackendCapabilities, Probe
from mm3.contract.errors import BackendUnavailableError, InputError, PluginError, UnknownBackendError
from mm3.contract.hookspecs import HOOK_NAMES, OP_HOOKS, PROJECT

if TYPE_CHECKING:
    from mm3.contract.batch import BatchMetadata
    from mm3.contract.buffers import PagedKVCache
    from mm3.contract.params import SparseAttentionParams

__all__ = [
    "ENTRY_POINT_GROUP",
    "CORE_DISTRIBUTION",
    "Registry",
    "Backend",
    "PluginSource",
    "PluginProblem",
    "ProblemStage",
    "PluginLoadWarning",
    "list_entry_points",
    "default_registry",
    "reset_default_registry",
]

ENTRY_POINT_GROUP = "mm3.backends"
CORE_DISTRIBUTION = "mm3"
"""The distribution whose entry points are built-ins (kept by ``no_plugin_autoload``)."""

ProblemStage = Literal["disabled", "not_found", "import", "register", "hooks",
                       "capabilities", "duplicate"]
"""Where a plugin was excluded: ``disabled`` by a setting; an allow-listed name
``not_found``; ``import`` failed; ``register`` = pluggy rejected a hookimpl
signature; ``hooks`` = unknown/missing/unsupported hooks; ``capabilities``
invalid; ``duplicate`` backend name."""

DeviceLike = Union[str, torch.device]


class PluginLoadWarning(UserWarning):
    """A backend plugin was excluded because it is broken; see ``mm3 backends``."""


def list_entry_points(group: str = ENTRY_POINT_GROUP) -> Sequence[Any]:
    """The installed entry points of ``group``.

    Kept as a module-level function so tests can substitute fake entry points
    (objects with ``.name``, ``.value``, ``.load()`` and ``.dist``).
    """
    return tuple(importlib.metadata.entry_points(group=group))


@dataclass(frozen=True)
class PluginSource:
    """Where a plugin came from, for diagnostics and error messages.

    ``entry_point`` is the entry-point name, or ``"explicit"`` for a plugin
    handed to :class:`Registry` / :meth:`Registry.register` directly.
    ``value`` is the import target (``"pkg.module:attr"``) or the plugin's
    module/qualified name.

    Example:
        >>> str(PluginSource("mm3", "0.1.0", "cpu_ref", "mm3_backends.cpu_ref.plugin"))
        'mm3 0.1.0 (entry point cpu_ref = mm3_backends.cpu_ref.plugin)'
    """

    distribution: Optional[str] = None
    version: Optional[str] = None
    entry_point: str = "explicit"
    value: Optional[str] = None

    @property
    def is_explicit(self) -> bool:
        return self.entry_point == "explicit"

    @property
    def dist_label(self) -> str:
        """``"name version"``, or ``"explicit"`` / ``"unknown distribution"``."""
        if self.distribution:
            return f"{self.distribution} {self.version}" if self.version else self.distribution
        return "explicit" if self.is_explicit else "unknown distribution"

    def __str__(self) -> str:
        if self.is_explicit:
            return f"explicit plugin {self.value}" if self.value else "explicit plugin"
        return f"{self.dist_label} (entry point {self.entry_point} = {self.value})"


@dataclass(frozen=True)
class PluginProblem:
    """One excluded plugin: who, from which distribution, at which stage, why.

    ``name`` is the entry-point name (or the backend name / plugin name for an
    explicit plugin); ``backend`` is the declared backend name when it got that
    far; ``details`` holds a full traceback when there is one.
    """

    name: str
    source: PluginSource
    stage: ProblemStage
    error: str
    backend: Optional[str] = None
    details: str = field(default="", repr=False, compare=False)

    @property
    def distribution(self) -> Optional[str]:
        return self.source.distribution

    @property
    def version(self) -> Optional[str]:
        return self.source.version

    def __str__(self) -> str:
        return f"{self.name} [{self.stage}] from {self.source}: {self.error}"


def _exc_line(exc: BaseException) -> str:
    """The last line of a traceback: ``"ModuleNotFoundError: No module named 'x'"``.

    A pydantic ``ValidationError`` (e.g. ``BackendCapabilities(...)`` built with a
    bad field inside a plugin) spans several lines; it becomes one line naming
    each field, so ``mm3 backends`` can print it as one readable line.
    """
    if isinstance(exc, ValidationError):
        fields = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or '(model)'}: {err['msg']}"
            + (f" (got {err['input']!r})" if err["type"] != "missing" else "")
            for err in exc.errors())
        return f"ValidationError: invalid {exc.title}: {fields}"
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def _plugin_label(plugin: object) -> str:
    if isinstance(plugin, types.ModuleType):
        return plugin.__name__
    if inspect.isclass(plugin):
        return f"{plugin.__module__}.{plugin.__qualname__}"
    cls = type(plugin)
    return f"{cls.__module__}.{cls.__qualname__} instance"


def _adapt(fn: Callable[..., Any], impl_args: Sequence[str], spec_args: Sequence[str]) -> Callable[..., Any]:
    """A callable taking the spec's arguments (positional or keyword) and calling ``fn``.

    pluggy lets a hookimpl take any subset of the spec's arguments, in any
    order. The usual case (same names, same order) binds ``fn`` itself: zero
    overhead. Otherwise a small adapter maps arguments by name.
    """
    if tuple(impl_args) == tuple(spec_args):
        return fn
    spec_args = tuple(spec_args)
    impl_args = tuple(impl_args)

    def adapter(*args: Any, **kwargs: Any) -> Any:
        values = dict(zip(spec_args, args))
        values.update(kwargs)
        return fn(**{n: values[n] for n in impl_args})

    adapter.__wrapped__ = fn  # type: ignore[attr-defined]
    return adapter


class Backend:
    """A validated backend with its own hook implementations bound for direct calls.

    Obtained from :meth:`Registry.get` / :meth:`Registry.backends`; not built by
    hand. Op methods call the plugin's function directly: no pluggy dispatch.

    Example:
        >>> be = default_registry().get("cpu_ref")                  # doctest: +SKIP
        >>> be.capabilities.topk_layout, be.source.distribution     # doctest: +SKIP
        ('head_major', 'mm3')
        >>> buf = be.alloc_topk_buffer(1024, 1, 16, "cpu")          # doctest: +SKIP
        >>> be.index_topk(index_q, caches, batch, params, buf.rows(0, T))  # doctest: +SKIP
    """

    def __init__(self, plugin: object, capabilities: BackendCapabilities, source: PluginSource,
                 impls: dict[str, Callable[..., Any]]) -> None:
        self.plugin = plugin
        self.capabilities = capabilities
        self.source = source
        self._impls = dict(impls)
        self._probe_cache: dict[str, Probe] = {}
        # Instance attributes shadow the raising class methods below, so a call
        # is exactly one call of the plugin's function (see module docstring).
        for op, hook in OP_HOOKS.items():
            if op in capabilities.ops and hook in impls:
                setattr(self, hook, impls[hook])

    # -- facts ------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.capabilities.name

    @property
    def priority(self) -> int:
        return self.capabilities.priority

    @property
    def hooks(self) -> frozenset[str]:
        """Names of the hooks this plugin implements."""
        return frozenset(self._impls)

    def provides(self, op: str) -> bool:
        """True when the backend declares ``op`` ("index_topk" | "attention") and implements it."""
        if op not in ALL_OPS:
            raise InputError(f"unknown op {op!r}; ops are {sorted(ALL_OPS)}")
        return op in self.capabilities.ops and OP_HOOKS[op] in self._impls

    # -- probe ----------------------------------------------------------------------
    def probe(self, device: DeviceLike) -> Probe:
        """Can this backend run on ``device``? Cached per device string.

        A probe that raises or returns something other than a :class:`Probe`
        yields ``Probe.no(...)`` naming the problem; it never propagates.
        """
        dev = torch.device(device) if not isinstance(device, torch.device) else device
        key = str(dev)
        cached = self._probe_cache.get(key)
        if cached is not None:
            return cached
        fn = self._impls.get("backend_probe")
        if fn is None:
            result = Probe.yes("no backend_probe hook; assumed available")
        else:
            try:
                got = fn(device=dev)
            except Exception as e:  # a probe must not take selection down
                result = Probe.no(f"probe raised {type(e).__name__}: {e}")
            else:
                if isinstance(got, Probe):
                    result = got
                else:
                    result = Probe.no(f"backend_probe returned {type(got).__name__} {got!r}, "
                                      f"expected mm3.Probe (return Probe.yes() or Probe.no(reason))")
        # A racing thread may probe twice; both results are equal and the write is atomic.
        self._probe_cache[key] = result
        return result

    # -- ops ----------------------------------------------------------------------------
    def alloc_topk_buffer(self, num_tokens: int, num_heads: int, topk: int,
                          device: DeviceLike) -> TopkBuffer:
        """A persistent top-k buffer in this backend's declared ``topk_layout``.

        Uses the plugin's ``alloc_topk_buffer`` hook when it has one, else
        ``TopkBuffer.allocate(..., layout=capabilities.topk_layout)``.
        """
        dev = torch.device(device) if not isinstance(device, torch.device) else device
        fn = self._impls.get("alloc_topk_buffer")
        if fn is None:
            return TopkBuffer.allocate(num_tokens, num_heads, topk,
                                       layout=self.capabilities.topk_layout, device=dev)
        buf = fn(num_tokens=num_tokens, num_heads=num_heads, topk=topk, device=dev)
        if not isinstance(buf, TopkBuffer):
            raise PluginError(
                f"backend {self.name!r} ({self.source}): alloc_topk_buffer returned "
                f"{type(buf).__name__}, expected mm3.TopkBuffer; wrap the tensor with "
                f"TopkBuffer(tensor, layout) or drop the hook to use the default allocation")
        if buf.layout != self.capabilities.topk_layout:
            raise PluginError(
                f"backend {self.name!r} ({self.source}): alloc_topk_buffer returned a {buf.layout} "
                f"buffer but capabilities declare topk_layout={self.capabilities.topk_layout!r}; "
                f"make them agree")
        if (buf.num_heads, buf.num_tokens, buf.topk) != (num_heads, num_tokens, topk):
            raise PluginError(
                f"backend {self.name!r} ({self.source}): alloc_topk_buffer returned "
                f"[H={buf.num_heads}, T={buf.num_tokens}, K={buf.topk}], asked for "
                f"[H={num_heads}, T={num_tokens}, K={topk}]")
        return buf

    def _missing(self, op: str) -> BackendUnavailableError:
        return BackendUnavailableError(
            f"backend {self.name!r} does not provide {op!r} (its capabilities declare ops "
            f"{sorted(self.capabilities.ops)}, hooks {sorted(self._impls)}); select another "
            f"backend for this op, e.g. indexer_backend=... / MM3_INDEXER_BACKEND")

    def index_topk(self, index_q: "torch.Tensor", caches: "PagedKVCache", batch: "BatchMetadata",
                   params: "SparseAttentionParams", out: TopkBuffer) -> None:
        """The indexer (SPEC §3). Replaced per instance by the plugin's function when provided."""
        raise self._missing("index_topk")

    def attention_forward(self, q: "torch.Tensor", caches: "PagedKVCache", topk: TopkBuffer,
                          batch: "BatchMetadata", params: "SparseAttentionParams",
                          out: "torch.Tensor") -> None:
        """Sparse attention (SPEC §4). Replaced per instance by the plugin's function when provided."""
        raise self._missing("attention")

    def __repr__(self) -> str:
        c = self.capabilities
        return (f"Backend({c.name!r}, priority={c.priority}, ops={sorted(c.ops)}, "
                f"topk_layout={c.topk_layout!r}, source={self.source!s})")


@dataclass
class _Candidate:
    """A plugin that passed its own checks, awaiting the duplicate-name check."""

    name: str
    plugin: object
    source: PluginSource
    capabilities: BackendCapabilities
    impls: dict[str, Callable[..., Any]]
    pm_name: str


class Registry:
    """The set of backends: discovered, validated, bound, diagnosable.

    Args:
        plugins: plugins (modules or objects with ``@hookimpl`` functions, or
            ``"pkg.module"`` import paths) registered as ``explicit``.
        entry_points: also load the ``mm3.backends`` entry points (default).
            ``Registry(plugins=[...], entry_points=False)`` is fully isolated.
        settings: an :class:`mm3.config.Settings` (or any object with
            ``plugins``, ``disable_plugins`` and ``no_plugin_autoload``) for the
            allow/deny lists; default ``Settings()`` at load time (env + files).

    Example:
        >>> reg = Registry(plugins=[fake_backend], entry_points=False)  # doctest: +SKIP
        >>> reg.names()                                                 # doctest: +SKIP
        ['fake']
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

    def get(self, name: str) -> Backend:
        """The backend called ``name``.

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
        msg = f"unknown backend {name!r}; known backends: {', '.join(known) or '(none)'}"
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
            >>> be = Registry(entry_points=False).register(my_plugin)  # doctest: +SKIP
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
        candidates: list[_Candidate] = []
        for plugin in self._initial:
            src = self._explicit_source(plugin)
            if isinstance(plugin, str):
                try:
                    plugin = importlib.import_module(plugin)
                except Exception as e:
                    self._report(PluginProblem(src.value or str(plugin), src, "import", _exc_line(e),
                                               details=traceback.format_exc()))
                    continue
            self._add_candidate(candidates, self._validate(plugin, src, name_hint=None))
        if self._use_entry_points:
            self._load_entry_points(candidates)
        self._resolve_duplicates(candidates)

    def _load_entry_points(self, candidates: list[_Candidate]) -> None:
        settings = self._settings
        if settings is None:
            from mm3.config import Settings  # lazy: config is only needed for entry points

            settings = Settings()
        allow = set(settings.plugins) if settings.plugins is not None else None
        deny = set(settings.disable_plugins or ())
        no_autoload = bool(settings.no_plugin_autoload)

        seen_names: set[str] = set()
        for ep in list_entry_points(ENTRY_POINT_GROUP):
            dist = getattr(ep, "dist", None)
            dist_name = getattr(dist, "name", None) if dist is not None else None
            dist_version = getattr(dist, "version", None) if dist is not None else None
            src = PluginSource(dist_name, dist_version, ep.name, getattr(ep, "value", None))
            ids = {ep.name} | ({dist_name} if dist_name else set())
            seen_names |= ids
            reason = None
            if ids & deny:
                reason = (f"excluded by MM3_DISABLE_PLUGINS (disable_plugins="
                          f"{sorted(deny)}); remove {sorted(ids & deny)[0]!r} from it to load")
            elif allow is not None and not ids & allow:
                reason = (f"excluded by MM3_PLUGINS allow-list (plugins={sorted(allow)}); "
                          f"add {ep.name!r} to it to load")
            elif no_autoload and allow is None and dist_name != CORE_DISTRIBUTION:
                reason = (f"excluded by MM3_NO_PLUGIN_AUTOLOAD (third-party plugins load only "
                          f"when named in MM3_PLUGINS); set MM3_PLUGINS={ep.name} to load it")
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
                    f"{_exc_line(e)} (while importing {src.value}; fix or uninstall "
                    f"{src.dist_label}, or set MM3_DISABLE_PLUGINS={ep.name})",
                    details=traceback.format_exc()))
                continue
            got = self._validate(plugin, src, name_hint=ep.name)
            if isinstance(got, _Candidate) and got.name in deny:
                # Denied by backend name (the entry point is named differently).
                self._pm.unregister(name=got.pm_name)
                self._problems.append(PluginProblem(
                    ep.name, src, "disabled",
                    f"backend {got.name!r} excluded by MM3_DISABLE_PLUGINS (disable_plugins="
                    f"{sorted(deny)}); remove {got.name!r} from it to load", backend=got.name))
                continue
            self._add_candidate(candidates, got)
        if allow:
            for missing in sorted(allow - seen_names):
                self._problems.append(PluginProblem(
                    missing, PluginSource(entry_point=missing), "not_found",
                    f"MM3_PLUGINS names {missing!r} but no {ENTRY_POINT_GROUP!r} entry point or "
                    f"distribution has that name; installed: {sorted(seen_names) or '(none)'}"))

    def _add_candidate(self, out: list[_Candidate], got: Union[_Candidate, PluginProblem]) -> None:
        if isinstance(got, PluginProblem):
            self._report(got)
        else:
            out.append(got)

    def _resolve_duplicates(self, candidates: list[_Candidate]) -> None:
        by_name: dict[str, list[_Candidate]] = {}
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
        value = plugin if isinstance(plugin, str) else _plugin_label(plugin)
        return PluginSource(entry_point="explicit", value=value)

    # -- validation -----------------------------------------------------------------------
    def _validate(self, plugin: object, source: PluginSource,
                  name_hint: Optional[str]) -> Union[_Candidate, PluginProblem]:
        """Register ``plugin`` in the plugin manager and check it; unregister it on failure."""
        label = name_hint or source.value or _plugin_label(plugin)
        self._counter += 1
        # A unique pluggy name per plugin: two entry points may point at one module
        # name in different distributions, and pluggy names must be unique.
        pm_name = f"{label}#{self._counter}"
        if self._pm.is_registered(plugin):
            return PluginProblem(label, source, "register",
                                 f"plugin object {_plugin_label(plugin)} is already registered "
                                 f"(as {self._pm.get_name(plugin)!r}); register each plugin once")
        try:
            self._pm.register(plugin, name=pm_name)
        except pluggy.PluginValidationError as e:
            # pluggy does not roll back a half-done registration: do it here so no
            # hookimpl of the rejected plugin stays in the manager.
            if self._pm.has_plugin(pm_name):
                self._pm.unregister(name=pm_name)
            return PluginProblem(label, source, "register",
                                 " ".join(str(e).split()) + "; make the hookimpl's arguments a "
                                 "subset of the hookspec's (see mm3.contract.hookspecs)")
        except Exception as e:  # e.g. an attribute that raises on access
            if self._pm.has_plugin(pm_name):
                self._pm.unregister(name=pm_name)
            return PluginProblem(label, source, "register", _exc_line(e),
                                 details=traceback.format_exc())

        def fail(stage: ProblemStage, error: str, backend: Optional[str] = None,
                 details: str = "") -> PluginProblem:
            self._pm.unregister(name=pm_name)
            return PluginProblem(label, source, stage, error, backend=backend, details=details)

        # Collect this plugin's own hookimpls (never another plugin's).
        impls: dict[str, Callable[..., Any]] = {}
        for caller in self._pm.get_hookcallers(plugin) or ():
            own = [i for i in caller.get_hookimpls() if i.plugin is plugin]
            if not caller.has_spec():
                close = difflib.get_close_matches(caller.name, HOOK_NAMES, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                return fail("hooks", f"unknown hook {caller.name!r}: {hint}valid hooks are "
                                     f"{', '.join(HOOK_NAMES)}")
            if len(own) != 1:
                return fail("hooks", f"{len(own)} implementations of hook {caller.name!r} in one "
                                     f"plugin; a backend implements each hook once")
            impl = own[0]
            if impl.hookwrapper or impl.wrapper:
                return fail("hooks", f"hook {caller.name!r} is declared as a wrapper; backends "
                                     f"implement hooks directly (drop wrapper=/hookwrapper=)")
            assert caller.spec is not None
            impls[caller.name] = _adapt(impl.function, impl.argnames, caller.spec.argnames)

        caps_fn = impls.get("backend_capabilities")
        if caps_fn is None:
            return fail("hooks", "no @hookimpl backend_capabilities(); every backend must declare "
                                 "its capabilities (see mm3.contract.hookspecs)")
        try:
            raw = caps_fn()
        except Exception as e:
            return fail("capabilities", f"backend_capabilities() raised {_exc_line(e)}",
                        details=traceback.format_exc())
        try:
            if isinstance(raw, BackendCapabilities):
                caps = raw
            elif isinstance(raw, dict):
                caps = BackendCapabilities.model_validate(raw)
            else:
                return fail("capabilities", f"backend_capabilities() returned {type(raw).__name__}; "
                                            f"return a BackendCapabilities or a dict of its fields")
        except ValidationError as e:
            backend = raw.get("name") if isinstance(raw.get("name"), str) else None
            fields = "; ".join(
                f"{'.'.join(str(x) for x in err['loc']) or '(model)'}: {err['msg']}"
                + (f" (got {err['input']!r})" if err["type"] != "missing" else "")
                for err in e.errors())
            return fail("capabilities", f"invalid capabilities: {fields}", backend=backend)

        missing = [op for op in sorted(caps.ops) if OP_HOOKS[op] not in impls]
        if missing:
            hooks = ", ".join(OP_HOOKS[op] for op in missing)
            return fail("hooks", f"backend {caps.name!r}: capabilities declare op(s) {missing} "
                                 f"but the plugin has no "
                                 f"@hookimpl {hooks}; implement it or remove the op from "
                                 f"capabilities.ops", backend=caps.name)

        return _Candidate(caps.name, plugin, source, caps, impls, pm_name)


# -- the process-wide registry ----------------------------------------------------------------

_default: Optional[Registry] = None
_default_lock = threading.Lock()


def default_registry() -> Registry:
    """The process-wide registry (entry points + Settings from env/files); created once.

    Example:
        >>> default_registry().names()   # doctest: +SKIP
        ['cuda', 'cpu_ref']
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
    """Forget the process-wide registry; the next :func:`default_registry` loads afresh.

    Use after changing ``MM3_*`` settings or installing a plugin in-process.
    """
    global _default
    with _default_lock:
        _default = None


def _measure_dispatch(number: int = 200_000, repeat: int = 7) -> dict[str, float]:
    """Per-call overhead (microseconds, median) of a bound call vs ``pm.hook`` dispatch."""
    import statistics
    import timeit

    class _Trivial:
        @_hookspecs.hookimpl
        def backend_capabilities(self) -> BackendCapabilities:
            return BackendCapabilities(name="trivial", ops={"index_topk"}, device_types={"cpu"},
                                       topk_layout="head_major")

        @_hookspecs.hookimpl
        def index_topk(self, index_q, caches, batch, params, out):  # type: ignore[no-untyped-def]
            return None

    reg = Registry([_Trivial()], entry_points=False)
    be = reg.get("trivial")
    hook = reg.plugin_manager.hook.index_topk
    bound = timeit.repeat(lambda: be.index_topk(1, 2, 3, 4, 5), number=number, repeat=repeat)
    via_pm = timeit.repeat(lambda: hook(index_q=1, caches=2, batch=3, params=4, out=5),
                           number=number, repeat=repeat)
    empty = timeit.repeat(lambda: None, number=number, repeat=repeat)
    base = statistics.median(empty)
    return {
        "pm.hook": (statistics.median(via_pm) - base) / number * 1e6,
        "bound": (statistics.median(bound) - base) / number * 1e6,
    }

