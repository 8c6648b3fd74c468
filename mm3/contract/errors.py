"""Exceptions raised by mm3. Every message says what was wrong and how to fix it.

All derive from :class:`MM3Error`, so ``except mm3.MM3Error`` catches anything
the library rejects; each also derives from the matching builtin
(``ValueError``, ``LookupError``, ``RuntimeError``) for code that expects those.
"""

from __future__ import annotations

import difflib
from typing import Mapping, Sequence

from pydantic import ValidationError

__all__ = [
    "MM3Error",
    "InputError",
    "ConfigError",
    "UnknownBackendError",
    "BackendUnavailableError",
    "NoBackendError",
    "PluginError",
    "ContractViolation",
    "describe_validation_error",
]


class MM3Error(Exception):
    """Base class of every error mm3 raises on purpose: ``except mm3.MM3Error`` catches them all.

    Example:
        >>> import mm3
        >>> try:
        ...     mm3.SparseAttentionParams.minimax_m3(tp_size=3)
        ... except mm3.MM3Error as e:
        ...     print(type(e).__name__, "-", e)
        InputError - MiniMax-M3 runs at tp_size 1, 2, 4 or 8, got 3
    """


class InputError(MM3Error, ValueError):
    """A tensor, batch description or parameter is invalid (wrong dtype, shape, device, range).

    Also a ``ValueError``. A backend's hook raises it for input no capability
    field can rule out, naming the argument, the value and what it needs.

    Example:
        >>> import mm3
        >>> mm3.BatchMetadata.build([1], [5], [[0]], block_size=0)
        Traceback (most recent call last):
        ...
        mm3.contract.errors.InputError: block_size must be a positive int, got 0
    """


class ConfigError(MM3Error, ValueError):
    """A setting, environment variable or config file is malformed or unknown.

    Example:
        >>> from mm3.runtime.config import Settings
        >>> Settings(bakend="cuda")
        Traceback (most recent call last):
        ...
        mm3.contract.errors.ConfigError: invalid mm3 settings: unknown setting 'bakend': did you mean 'backend'? ...
    """


class UnknownBackendError(MM3Error, LookupError):
    """A backend name was asked for that no registered plugin provides; the message lists the known ones.

    Example:
        >>> import mm3
        >>> with mm3.use_backend("cpu_rf"):
        ...     pass
        Traceback (most recent call last):
        ...
        mm3.contract.errors.UnknownBackendError: unknown backend 'cpu_rf' (from use_backend); known backends: ...
    """


class BackendUnavailableError(MM3Error, RuntimeError):
    """A named backend exists but cannot serve this request here; the message lists why.

    Example:
        >>> import mm3
        >>> p = mm3.SparseAttentionParams.minimax_m3(tp_size=8)
        >>> mm3.SparseAttention(p, max_num_tokens=8, backend="cpu_ref", max_decode_query_len=32)
        Traceback (most recent call last):
        ...
        mm3.contract.errors.BackendUnavailableError: backend 'cpu_ref' (named by backend) cannot serve ...
    """


class NoBackendError(MM3Error, RuntimeError):
    """``auto`` selection found no available, capable backend; the message lists each candidate.

    Example (a registry of one backend that serves decode query lengths up to 16):
        >>> import mm3
        >>> from mm3.runtime.registry import Registry
        >>> from mm3.testing.mock import MockBackend
        >>> only = Registry([MockBackend("ref", max_decode_query_len=16)], entry_points=False)
        >>> p = mm3.SparseAttentionParams.minimax_m3(tp_size=8)
        >>> mm3.SparseAttention(p, max_num_tokens=8, max_decode_query_len=32, registry=only)
        Traceback (most recent call last):
        ...
        mm3.contract.errors.NoBackendError: no backend can serve the attention op on cpu ...
    """


class PluginError(MM3Error, RuntimeError):
    """A plugin is malformed (bad hook, invalid capabilities, duplicate name), or a hook of it raised.

    Raised from a hook's own exception (``__cause__``), with ``backend`` and ``hook``
    attributes then (docs/errors.md, "A backend that fails mid-step").

    Example:
        >>> issubclass(PluginError, RuntimeError), issubclass(PluginError, MM3Error)
        (True, True)
    """


class ContractViolation(MM3Error, RuntimeError):
    """A backend broke the contract of docs/spec.md (layout, row range, invalid ids, bad output).

    Raised by the contract guard (``check_contracts``); the message names the
    backend, the hook, the rule and the first offending row, and the
    attributes ``backend``, ``hook``, ``rule`` (and ``head``, ``token``, ``row``) carry them.

    Example:
        >>> issubclass(ContractViolation, RuntimeError), issubclass(ContractViolation, MM3Error)
        (True, True)
    """


def describe_validation_error(error: ValidationError, *, fields: Sequence[str] = (),
                              sources: Mapping[str, str] = {}, item: str = "field") -> str:
    """One line for a pydantic error: each invalid ``item``, what is wrong, the value given.

    ``fields`` are the model's valid names (for a did-you-mean on an unknown
    one); ``sources`` says where a field's value came from ("env MM3_X"...).
    Every mm3 message about a pydantic model (params, capabilities, settings,
    requirements) is written here.

    Example:
        >>> from pydantic import BaseModel, ConfigDict
        >>> class M(BaseModel):
        ...     model_config = ConfigDict(extra="forbid")
        ...     topk: int
        >>> try:
        ...     M(topk="many", top_k=3)
        ... except ValidationError as e:
        ...     print(describe_validation_error(e, fields=["topk"]))
        topk: Input should be a valid integer, unable to parse string as an integer (got 'many'); unknown field 'top_k': did you mean 'topk'? valid fields are topk
    """
    parts = []
    for err in error.errors():
        top = str(err["loc"][0]) if err["loc"] else ""
        loc = ".".join(str(x) for x in err["loc"])
        origin = f" (from {sources[top]})" if top in sources else ""
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(top, list(fields), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            valid = f"valid {item}s are {', '.join(fields)}" if fields else "remove it"
            parts.append(f"unknown {item} {loc!r}{origin}: {hint}{valid}")
            continue
        msg = str(err["msg"]).removeprefix("Value error, ")
        if not loc:  # a rule across fields: the input is the whole model, not worth repeating
            parts.append(msg)
            continue
        got = "" if err["type"] == "missing" else f" (got {err['input']!r})"
        parts.append(f"{loc}{origin}: {msg}{got}")
    return "; ".join(parts)
