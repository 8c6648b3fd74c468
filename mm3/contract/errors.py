"""Exceptions raised by mm3. Every message says what was wrong and how to fix it.

All derive from :class:`MM3Error`, so ``except mm3.MM3Error`` catches anything
the library rejects; each also derives from the matching builtin
(``ValueError``, ``LookupError``, ``RuntimeError``) for code that expects those.
"""

from __future__ import annotations

__all__ = [
    "MM3Error",
    "InputError",
    "ConfigError",
    "UnknownBackendError",
    "BackendUnavailableError",
    "NoBackendError",
    "PluginError",
    "ContractViolation",
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
    """A plugin is malformed (bad hook, invalid capabilities, duplicate name)."""


class ContractViolation(MM3Error, RuntimeError):
    """A backend broke the SPEC contract (layout, row range, invalid ids, bad output).

    Raised by the contract guard (``check_contracts``); the message names the
    backend, the hook, the rule and the first offending row.
    """
