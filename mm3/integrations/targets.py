"""The bound backends a drop-in call runs on: mm3's selection for the call's requirements, bound once.

An engine's op (a vLLM ``minimax_m3_*`` function) carries no layer object, so
this module keeps one :class:`~mm3.runtime.step.OpTarget` per set of
requirements (shapes, dtypes, device, CUDA-graph capture) and backend names in
force. Binding follows the layer's rules: the names come from a
``mm3.use_backend`` scope, else from the settings (``MM3_BACKEND``,
``MM3_INDEXER_BACKEND``, the config file; :func:`configure` replaces them),
:func:`~mm3.runtime.selection.select` chooses and explains, and
``check_contracts`` decides which calls the contract guard checks. Each target
runs its calls through the step's boundary as a layer's does (:mod:`mm3.runtime.step`).

Example:
    >>> import torch, mm3
    >>> from mm3.runtime.selection import requirements_for
    >>> p = mm3.SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16,
    ...     num_index_heads=2, index_head_dim=16, block_size=16, topk=4)
    >>> req = requirements_for(p, torch.float32, torch.float32, "cpu")
    >>> with mm3.use_backend("cpu_ref"):
    ...     bound = bind(p, req, torch.device("cpu"))
    >>> bound.selection.attention.name, bound is bind(p, req, torch.device("cpu"), names=("cpu_ref", None))
    ('cpu_ref', True)
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

from mm3.contract.capabilities import Requirements
from mm3.contract.errors import InputError
from mm3.contract.params import SparseAttentionParams
from mm3.runtime import binding
from mm3.runtime.binding import Binding
from mm3.runtime.config import Settings, default_settings
from mm3.runtime.registry import Registry, default_registry
from mm3.runtime.scope import SCOPE, current_scope
from mm3.runtime.selection import Selection, describe_requirements

__all__ = ["Binding", "bind", "bind_call", "configure", "settings", "selections", "check_page_ids", "MAX_CHOICES",
           "Made", "context", "memo", "remember"]

#: choices kept before the cache starts over (one per set of requirements: shapes, dtypes, device)
MAX_CHOICES = 1024

_BOUND: dict[tuple[object, ...], Binding] = {}
_LOCK = threading.Lock()
_CONFIG: dict[str, Optional[object]] = {"settings": None, "registry": None}
#: the drop-ins' memos of their calls (:func:`memo`), forgotten with the bound choices
_MEMOS: list[dict[Any, Any]] = []


def memo() -> dict[Any, Any]:
    """A new dict that is emptied whenever the bound choices are forgotten (:func:`configure`, or the cache
    starting over): where a drop-in keeps what it worked out for a kind of call, its target among it, so a
    later call of that kind looks nothing up again that a configuration could change.

    Example:
        >>> m = memo(); m["call"] = "what it worked out"
        >>> configure(); m
        {}
    """
    made: dict[Any, Any] = {}
    _MEMOS.append(made)
    return made


def remember(kept: dict[Any, Any], key: Any, value: Any) -> None:
    """``kept[key] = value`` in a memo of :func:`memo`, which starts over past :data:`MAX_CHOICES` entries."""
    if len(kept) >= MAX_CHOICES:
        kept.clear()
    kept[key] = value


def _forget() -> None:
    _BOUND.clear()
    for m in _MEMOS:
        m.clear()


def context() -> tuple[Any, Settings, Registry]:
    """What a choice depends on besides a call's requirements: ``(use_backend scope, settings, registry)``.
    A call whose context is the one its memo was bound in (the same objects) may use the memo's target.

    Example:
        >>> context() == context()
        True
    """
    s, r = _CONFIG["settings"], _CONFIG["registry"]
    return (SCOPE.get(), s if isinstance(s, Settings) else default_settings(),
            r if isinstance(r, Registry) else default_registry())


def configure(settings: Optional[Settings] = None, registry: Optional[Registry] = None) -> None:
    """Use ``settings`` / ``registry`` for every later drop-in call (``None``: the process's own).

    Forgets every bound choice, so the next call of each kind selects again.

    Example:
        >>> from mm3.runtime.config import Settings
        >>> configure(Settings(backend="cpu_ref", check_contracts="always"))
        >>> configure()    # back to the environment's settings
    """
    with _LOCK:
        _CONFIG.update(settings=settings, registry=registry)
        _forget()


def settings() -> Settings:
    """The settings drop-in calls follow: :func:`configure`'s, else the process's."""
    s = _CONFIG["settings"]
    return s if isinstance(s, Settings) else default_settings()


def _registry() -> Registry:
    r = _CONFIG["registry"]
    return r if isinstance(r, Registry) else default_registry()


class Made:
    """``(params, requirements, device)`` of a drop-in's choice, hashed once: a call looks its choice up every
    call, and hashing the two models costs about a microsecond each time (pass it as :func:`bind`'s ``made``).

    Example:
        >>> Made(("p", "r", "cpu")) == Made(("p", "r", "cpu")), len({Made((1, 2, 3)), Made((1, 2, 3))})
        (True, 1)
    """

    __slots__ = ("value", "_hash")

    def __init__(self, value: tuple[Any, ...]) -> None:
        self.value, self._hash = value, hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (type(other) is Made and self.value == other.value)  # type: ignore[attr-defined]


#: a drop-in call's requirements and its choice's key, by what the caller says they are made of
_REQUIREMENTS: dict[tuple[object, ...], tuple[Requirements, Made]] = {}


def bind_call(key: tuple[object, ...], make: Callable[[], Requirements], params: SparseAttentionParams,
              device: torch.device, graph: bool) -> Binding:
    """:func:`bind` for a drop-in function's call: its requirements made by ``make`` once per ``key`` (exactly
    what they are made of, the drop-in's name first) and its choice's key hashed once (:class:`Made`), so a
    call pays two dict lookups.

    Example:
        >>> from mm3.runtime.selection import requirements_for
        >>> p = SparseAttentionParams(num_heads=4, num_kv_heads=2, head_dim=16, num_index_heads=2,
        ...                           index_head_dim=16, block_size=16, topk=4)
        >>> cpu = torch.device("cpu")
        >>> b = bind_call(("doc", p, cpu), lambda: requirements_for(p, torch.float32, torch.float32, cpu), p,
        ...               cpu, False)
        >>> b is bind_call(("doc", p, cpu), lambda: None, p, cpu, False)   # made once: the second make unused
        True
    """
    got = _REQUIREMENTS.get(key)
    if got is None:
        if len(_REQUIREMENTS) >= MAX_CHOICES:
            _REQUIREMENTS.clear()
        req = make()
        got = _REQUIREMENTS[key] = (req, Made((params, req, str(device))))
    return bind(params, got[0], device, capturing=graph, made=got[1])


def bind(params: SparseAttentionParams, requirements: Requirements, device: torch.device,
         names: Optional[tuple[str, Optional[str]]] = None, *, capturing: bool = False,
         made: Optional[Made] = None) -> Binding:
    """The backends for ``requirements`` on ``device``, chosen once per requirements and names.

    ``names``: ``(backend, indexer_backend)``; default: the innermost ``use_backend``
    scope, else the settings'. Selection errors (``NoBackendError``,
    ``BackendUnavailableError``...) propagate with their explanation. ``made``: ``Made((params,
    requirements, str(device)))``, kept by the caller so each call hashes none of them again. ``capturing``:
    the call is being captured in a CUDA graph, where nothing may be bound (binding
    allocates device memory that a graph would re-initialise at every replay): the
    choice must exist from an eager call, else :class:`~mm3.InputError` says so.
    """
    settings_ = settings()
    if names is None:
        scope = current_scope()
        names = (scope.backend, scope.indexer_backend) if scope is not None else \
            (settings_.backend, settings_.indexer_backend)
    registry = _registry()
    key = (made or Made((params, requirements, str(device))), names, settings_.check_contracts,
           settings_.check_contents_with_sync, settings_.allow_fallback, registry)
    got = _BOUND.get(key)
    if got is not None:
        return got
    if capturing:
        raise InputError(f"the first call for {describe_requirements(requirements)} (backend names {names}) is "
                         f"inside CUDA-graph capture, where mm3 cannot select and bind backends: run one step "
                         f"of these shapes eagerly first (an engine's warm-up does)")
    with _LOCK:
        got = _BOUND.get(key)
        if got is None:
            if len(_BOUND) >= MAX_CHOICES:
                _forget()
            got = _BOUND[key] = binding.bind(params, requirements, names, device, settings_, registry)
    return got


def selections() -> list[Selection]:
    """The choices made so far (one per set of requirements): ``print(s.explain())`` for each."""
    return [b.selection for b in list(_BOUND.values())]


def check_page_ids() -> None:
    """Wait for the device and raise :class:`~mm3.InputError` if a call of any bound choice met bad batch
    contents on the device: a block-table entry that is not a page of its cache, or lengths and positions
    that contradict each other (a call reports its own target's faults at its next eager call; calls
    replayed in CUDA graphs only are reported here)."""
    for b in list(_BOUND.values()):
        b.target.flag.check()
