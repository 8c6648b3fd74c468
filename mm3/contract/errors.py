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
    """Base class of every error mm3 raises on purpose."""


class InputError(MM3Error, ValueError):
    """A tensor, batch description or parameter is invalid (wrong dtype, shape, device, range)."""


class ConfigError(MM3Error, ValueError):
    """A setting, environment variable or config file is malformed or unknown."""


class UnknownBackendError(MM3Error, LookupError):
    """A backend name was asked for that no registered plugin provides."""


class BackendUnavailableError(MM3Error, RuntimeError):
    """A named backend exists but cannot serve this request here; the message lists why."""


class NoBackendError(MM3Error, RuntimeError):
    """``auto`` selection found no available, capable backend; the message lists each candidate."""


class PluginError(MM3Error, RuntimeError):
    """A plugin is malformed (bad hook, invalid capabilities, duplicate name), or a hook of it raised.

    Raised from a hook's own exception (``__cause__``), with ``backend`` and ``hook``
    attributes then (docs/errors.md §6).
    """


class ContractViolation(MM3Error, RuntimeError):
    """A backend broke the contract of docs/spec.md (layout, row range, invalid ids, bad output).

    Raised by the contract guard (``check_contracts``); the message names the
    backend, the hook, the rule and the first offending row.
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
