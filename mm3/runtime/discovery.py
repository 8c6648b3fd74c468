"""Find backend plugins and decide which may load: entry points, sources, problems.

A backend is a pluggy plugin (a module or an object with ``@hookimpl``
functions, see :mod:`mm3.contract.hookspecs`). Built-ins and third-party
packages both register through the entry-point group ``mm3.backends``.
This module knows where a plugin came from (:class:`PluginSource`), why one
was excluded (:class:`PluginProblem`) and whether a plugin is a valid
backend (:func:`validate_plugin`); :mod:`mm3.runtime.registry` puts it together.

Behaviour:

* **Never fatal.** A plugin that fails to import, has a hookimpl whose
  arguments do not match the spec, implements a hook name that is not in the
  spec, declares invalid capabilities, declares an op without implementing its
  hook, or shares its backend name with another plugin is *excluded*: it is
  recorded as a :class:`PluginProblem` (with its distribution and the error),
  a :class:`PluginLoadWarning` is issued, and every other plugin keeps working.
* **Allow/deny lists** (``Settings.plugins``, ``Settings.disable_plugins``,
  ``Settings.no_plugin_autoload``) apply to entry points only; explicitly
  passed plugins are always registered. Excluded entry points are not imported
  and appear in ``Registry.problems()`` with stage ``"disabled"`` and the
  setting that excluded them (no warning: that was a request, not a fault).

  - ``plugins`` (``MM3_PLUGINS``): when set, only entry points whose name (or
    distribution name) is listed load.
  - ``disable_plugins`` (``MM3_DISABLE_PLUGINS``): the names are blocked in
    pluggy's plugin manager (``set_blocked``); entry points whose name or
    distribution name is blocked are skipped, and a loaded plugin whose
    *backend* name is blocked is dropped too.
  - ``no_plugin_autoload`` (``MM3_NO_PLUGIN_AUTOLOAD``): third-party entry
    points (distributions other than ``mm3``) load only when named in
    ``plugins``; mm3's own built-ins still load so the library stays usable.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
import traceback
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Sequence, Union

import pluggy
from pydantic import ValidationError

from mm3.contract.capabilities import BackendCapabilities
from mm3.contract.errors import describe_validation_error
from mm3.contract.hookspecs import HOOK_NAMES

__all__ = [
    "ENTRY_POINT_GROUP",
    "CORE_DISTRIBUTION",
    "PluginSource",
    "PluginProblem",
    "ProblemStage",
    "PluginLoadWarning",
    "Candidate",
    "list_entry_points",
    "entry_point_source",
    "exclusion",
    "validate_plugin",
    "exc_line",
    "plugin_label",
    "call_hookimpl",
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


def exc_line(exc: BaseException) -> str:
    """The last line of a traceback: ``"ModuleNotFoundError: No module named 'x'"``.

    A pydantic ``ValidationError`` (e.g. ``BackendCapabilities(...)`` built with a
    bad field inside a plugin) spans several lines; it becomes one line naming
    each field, so ``mm3 backends`` can print it as one readable line.
    """
    if isinstance(exc, ValidationError):
        return f"ValidationError: invalid {exc.title}: {describe_validation_error(exc)}"
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def plugin_label(plugin: object) -> str:
    if isinstance(plugin, types.ModuleType):
        return plugin.__name__
    if inspect.isclass(plugin):
        return f"{plugin.__module__}.{plugin.__qualname__}"
    cls = type(plugin)
    return f"{cls.__module__}.{cls.__qualname__} instance"


@dataclass
class Candidate:
    """A plugin that passed its own checks, awaiting the duplicate-name check."""

    name: str
    plugin: object
    source: PluginSource
    capabilities: BackendCapabilities
    impls: dict[str, pluggy.HookImpl]
    pm_name: str



def call_hookimpl(impl: pluggy.HookImpl, **kwargs: Any) -> Any:
    """Call one plugin's hookimpl the way pluggy does: with the arguments it names.

    A hookimpl may take any subset of its spec's arguments, in any order;
    pluggy parsed its names at registration (``impl.argnames``, and
    ``impl.kwargnames`` for those it takes with a default). This is that
    call for exactly one plugin, without a ``pm.hook`` dispatch.
    """
    return impl.function(*[kwargs[name] for name in impl.argnames],
                         **{name: kwargs[name] for name in impl.kwargnames if name in kwargs})


def entry_point_source(ep: Any) -> PluginSource:
    """Where entry point ``ep`` comes from: its distribution (name, version) and target."""
    dist = getattr(ep, "dist", None)
    dist_name = getattr(dist, "name", None) if dist is not None else None
    dist_version = getattr(dist, "version", None) if dist is not None else None
    return PluginSource(dist_name, dist_version, ep.name, getattr(ep, "value", None))


def exclusion(ep_name: str, source: PluginSource, settings: Any,
              is_blocked: Callable[[str], bool]) -> Optional[str]:
    """Why the settings exclude this entry point before it is imported, or None.

    ``settings`` has ``plugins``, ``disable_plugins`` and ``no_plugin_autoload``;
    ``is_blocked`` is the plugin manager's (``disable_plugins`` are blocked there).
    """
    allow = set(settings.plugins) if settings.plugins is not None else None
    ids = {ep_name} | ({source.distribution} if source.distribution else set())
    blocked = sorted(name for name in ids if is_blocked(name))
    if blocked:
        return (f"excluded by MM3_DISABLE_PLUGINS (disable_plugins="
                f"{sorted(settings.disable_plugins)}); remove {blocked[0]!r} from it to load")
    if allow is not None and not ids & allow:
        return (f"excluded by MM3_PLUGINS allow-list (plugins={sorted(allow)}); "
                f"add {ep_name!r} to it to load")
    if settings.no_plugin_autoload and allow is None and source.distribution != CORE_DISTRIBUTION:
        return (f"excluded by MM3_NO_PLUGIN_AUTOLOAD (third-party plugins load only "
                f"when named in MM3_PLUGINS); set MM3_PLUGINS={ep_name} to load it")
    return None


def validate_plugin(pm: pluggy.PluginManager, plugin: object, source: PluginSource, label: str,
                    pm_name: str) -> Union[Candidate, PluginProblem]:
    """Register ``plugin`` in ``pm`` as ``pm_name`` and check it; unregister it on failure.

    ``label`` names the plugin in a problem report (its entry point, or its module).
    """
    if pm.is_registered(plugin):
        return PluginProblem(label, source, "register",
                             f"plugin object {plugin_label(plugin)} is already registered "
                             f"(as {pm.get_name(plugin)!r}); register each plugin once")
    try:
        pm.register(plugin, name=pm_name)
    except pluggy.PluginValidationError as e:
        # pluggy does not roll back a half-done registration: do it here so no
        # hookimpl of the rejected plugin stays in the manager.
        if pm.has_plugin(pm_name):
            pm.unregister(name=pm_name)
        return PluginProblem(label, source, "register",
                             " ".join(str(e).split()) + "; make the hookimpl's arguments a "
                             "subset of the hookspec's (see mm3.contract.hookspecs)")
    except Exception as e:  # e.g. an attribute that raises on access
        if pm.has_plugin(pm_name):
            pm.unregister(name=pm_name)
        return PluginProblem(label, source, "register", exc_line(e),
                             details=traceback.format_exc())

    def fail(stage: ProblemStage, error: str, backend: Optional[str] = None,
             details: str = "") -> PluginProblem:
        pm.unregister(name=pm_name)
        return PluginProblem(label, source, stage, error, backend=backend, details=details)

    # Collect this plugin's own hookimpls (never another plugin's).
    impls: dict[str, pluggy.HookImpl] = {}
    for caller in pm.get_hookcallers(plugin) or ():
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
        impls[caller.name] = impl

    caps_fn = impls.get("backend_capabilities")
    if caps_fn is None:
        return fail("hooks", "no @hookimpl backend_capabilities(); every backend must declare "
                             "its capabilities (see mm3.contract.hookspecs)")
    try:
        raw = call_hookimpl(caps_fn)
    except Exception as e:
        return fail("capabilities", f"backend_capabilities() raised {exc_line(e)}",
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
        fields = list(BackendCapabilities.model_fields)
        return fail("capabilities", f"invalid capabilities: {describe_validation_error(e, fields=fields)}",
                    backend=backend)

    missing = [op for op in sorted(caps.ops) if op.hook not in impls]
    if missing:
        hooks = ", ".join(op.hook for op in missing)
        return fail("hooks", f"backend {caps.name!r}: capabilities declare op(s) {missing} "
                             f"but the plugin has no "
                             f"@hookimpl {hooks}; implement it or remove the op from "
                             f"capabilities.ops", backend=caps.name)

    return Candidate(caps.name, plugin, source, caps, impls, pm_name)
