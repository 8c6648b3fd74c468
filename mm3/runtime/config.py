"""Settings: which backend to use and which plugins to load, from arguments, env or a file.

Precedence, highest first: arguments (``Settings(backend="cuda")``), the
``MM3_*`` environment variables, one config file (the ``config`` argument or
``MM3_CONFIG``, else ``./mm3.toml``, else ``[tool.mm3]`` of
``./pyproject.toml``; never merged), defaults. docs/configuration.md has every
setting, its variable and its value syntax.

Mistakes are errors, never ignored: an unknown key in a file, an unknown
``MM3_*`` variable (``MM3_BACKEDN``), malformed TOML or an invalid value raises
:class:`~mm3.contract.errors.ConfigError` naming the key, where it came from
and the valid choices. Two ``MM3_*`` namespaces are not settings and pass
through: ``MM3_<PLUGIN>_*`` for an installed backend's entry point (a
plugin's own knobs) and :data:`RESERVED_ENV_PREFIXES` (tests, benchmarks).

Example:
    >>> s = Settings(backend="cpu_ref")
    >>> s.backend
    'cpu_ref'
    >>> dict((k, src) for k, _, src in explain_settings(s))["backend"]
    'argument'
"""

from __future__ import annotations

import difflib
import functools
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional, Union

from pydantic import PrivateAttr, TypeAdapter, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    PyprojectTomlConfigSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from mm3.contract.errors import ConfigError, describe_validation_error
from mm3.runtime import discovery

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pyproject pins tomli for 3.10
    import tomli as tomllib

__all__ = ["Settings", "BackendName", "default_settings", "reset_default_settings", "explain_settings",
           "ENV_PREFIX", "CONFIG_FILE_NAME", "PYPROJECT_TABLE", "RESERVED_ENV_PREFIXES"]

ENV_PREFIX = "MM3_"
CONFIG_FILE_NAME = "mm3.toml"
PYPROJECT_TABLE = ("tool", "mm3")
_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
RESERVED_ENV_PREFIXES = ("MM3_TEST_", "MM3_GPU_", "MM3_BENCH_")
"""``MM3_*`` namespaces owned by test suites and benchmarks, not by Settings."""


def _split_names(value: Any) -> Any:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``; lists pass through for pydantic to check."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class BackendName(str):
    """A backend name read by :class:`Settings`, carrying where it came from (``source``).

    It is the name itself (a ``str``) wherever it goes; selection reads
    ``source`` to say, when nobody provides that backend, which setting to fix.

    Example:
        >>> name = BackendName("cuda", "env MM3_BACKEND")
        >>> name == "cuda", name.source
        (True, 'env MM3_BACKEND')
    """

    source: str

    def __new__(cls, name: str, source: str) -> "BackendName":
        self = super().__new__(cls, name)
        self.source = source
        return self


class _ConfigFile:
    """The config file that applies (if any) and how to read it."""

    def __init__(self, path: Optional[Path], pyproject: bool, explicit: bool) -> None:
        self.path = path
        self.pyproject = pyproject
        self.explicit = explicit

    @property
    def label(self) -> str:
        if self.path is None:
            return "no config file"
        return f"file {self.path}" + (" [tool.mm3]" if self.pyproject else "")


def _env_lookup(name: str) -> Optional[str]:
    """Case-insensitive read of one environment variable (pydantic-settings matches that way)."""
    for key, value in os.environ.items():
        if key.upper() == name:
            return value
    return None


def _locate_config(init_kwargs: Mapping[str, Any]) -> _ConfigFile:
    given: Any = init_kwargs.get("config")
    if given is None:
        given = _env_lookup(ENV_PREFIX + "CONFIG") or None
    if given is not None:
        path = Path(given).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"config file {str(path)!r} (from {'the config argument' if 'config' in init_kwargs else 'MM3_CONFIG'}) "
                f"does not exist or is not a file; fix the path or unset it")
        return _ConfigFile(path.resolve(), path.name == "pyproject.toml", explicit=True)
    local = Path.cwd() / CONFIG_FILE_NAME
    if local.is_file():
        return _ConfigFile(local, False, explicit=False)
    pyproject = Path.cwd() / "pyproject.toml"
    if pyproject.is_file():
        return _ConfigFile(pyproject, True, explicit=False)
    return _ConfigFile(None, False, explicit=False)


def _plugin_env_prefixes() -> tuple[str, ...]:
    """``MM3_<ENTRY POINT NAME>_`` for every installed backend entry point.

    Listing entry points imports no plugin (about 2 ms), and it only happens
    when an ``MM3_*`` variable is not a setting.
    """
    try:
        names = [ep.name for ep in discovery.list_entry_points(discovery.ENTRY_POINT_GROUP)]
    except Exception:  # broken metadata must not turn into a config error
        names = []
    return tuple(f"{ENV_PREFIX}{n.upper()}_" for n in names)


def _check_env(settings_cls: type[BaseSettings]) -> None:
    valid = sorted(ENV_PREFIX + n.upper() for n in settings_cls.model_fields)
    unknown = [k for k in os.environ
               if k.upper().startswith(ENV_PREFIX) and k.upper() not in valid
               and not k.upper().startswith(RESERVED_ENV_PREFIXES)]
    if not unknown:
        return
    plugin_owned = _plugin_env_prefixes()
    for key in unknown:
        if key.upper().startswith(plugin_owned):
            continue
        close = difflib.get_close_matches(key.upper(), valid, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(
            f"unknown environment variable {key}: {hint}valid mm3 variables are {', '.join(valid)} "
            f"(plus MM3_<PLUGIN>_* for an installed backend plugin and "
            f"{', '.join(p + '*' for p in RESERVED_ENV_PREFIXES)} for tests and benchmarks); "
            f"rename or unset it")


def _file_source(settings_cls: type[BaseSettings], cfg: _ConfigFile) -> Optional[TomlConfigSettingsSource]:
    """A pydantic-settings TOML source for ``cfg``, with keys checked; None when no file applies."""
    if cfg.path is None:
        return None
    try:
        source: TomlConfigSettingsSource
        if cfg.pyproject:
            source = PyprojectTomlConfigSettingsSource(_pyproject_view(settings_cls), cfg.path)
        else:
            source = TomlConfigSettingsSource(settings_cls, toml_file=cfg.path)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"malformed TOML in config file {cfg.path}: {e}; fix the file") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {cfg.path}: {e}") from None
    except (AttributeError, TypeError):
        # pydantic-settings indexes [tool] / [tool.mm3] as tables and fails deep inside otherwise
        raise ConfigError(f"{cfg.label}: [tool] and [tool.mm3] must be tables of settings; "
                          f"fix the file") from None
    data = source.toml_data
    if not isinstance(data, dict):
        raise ConfigError(f"{cfg.label}: [tool.mm3] must be a table of settings, got "
                          f"{type(data).__name__}")
    valid = sorted(n for n in settings_cls.model_fields if n != "config")
    for key in data:
        if key == "config":
            raise ConfigError(f"{cfg.label}: 'config' cannot be set inside a config file; "
                              f"pass it as an argument or MM3_CONFIG")
        if key not in valid:
            close = difflib.get_close_matches(key.replace("-", "_"), valid, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            if isinstance(data[key], dict) and key in ("mm3", "tool"):
                hint = ("settings go at the top level of mm3.toml, with no table header (in "
                        "pyproject.toml they go under [tool.mm3]); ")
            raise ConfigError(f"unknown key {key!r} in {cfg.label}: {hint}valid keys are "
                              f"{', '.join(valid)}")
    return source


def _pyproject_view(settings_cls: type[BaseSettings]) -> type[BaseSettings]:
    """``settings_cls`` with ``pyproject_toml_table_header = ("tool", "mm3")``.

    The header lives on a never-instantiated subclass rather than on Settings
    itself: pydantic-settings warns about a header in ``model_config`` whenever
    the pyproject source is not in use (e.g. when ``mm3.toml`` applies).
    """
    view = _PYPROJECT_VIEWS.get(settings_cls)
    if view is None:
        view = type(f"_{settings_cls.__name__}PyprojectView", (settings_cls,), {
            "model_config": SettingsConfigDict(**{**settings_cls.model_config,
                                                  "pyproject_toml_table_header": PYPROJECT_TABLE}),
            "__module__": __name__,
        })
        _PYPROJECT_VIEWS[settings_cls] = view
    return view


_PYPROJECT_VIEWS: dict[type, type[BaseSettings]] = {}


class Settings(BaseSettings):
    """mm3's configuration; see the module docstring for sources and precedence.

    Fields:
        backend: attention backend name, or ``"auto"`` (highest-priority capable one).
        indexer_backend: indexer backend name; ``None`` = the attention backend if it
            provides ``index_topk``, else auto.
        plugins: allow-list of entry-point (or distribution) names to load; ``None`` = all.
        disable_plugins: entry-point, distribution or backend names never to load.
        no_plugin_autoload: load third-party entry points only when named in ``plugins``
            (mm3's own built-ins still load).
        check_contracts: when the contract guard (:mod:`mm3.debug`) checks backend calls:
            ``"first"`` (default) the first step of each kind of batch (decode, speculative
            decode, prefill, mixed) per backend pair of a layer, then it steps aside;
            ``"always"`` every step (synchronises per call: tests, debugging); ``"never"``.
            Booleans are accepted: true means ``"always"``, false ``"never"``.
        check_contents_with_sync: judge a device batch's contents (page ids, lengths, positions) on the
            host at every eager step, so a bad batch raises in the step that got it; each step then waits
            for the device (a synchronisation: for debugging). Default false: judged on the device, a
            fault raised at the next step or ``check_page_ids()`` (docs/errors.md §2.6).
        allow_fallback: a named backend that cannot serve falls back to ``auto``.
        config: explicit config file path.

    Example:
        >>> Settings(disable_plugins="rocm, cuda").disable_plugins
        ['rocm', 'cuda']
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        case_sensitive=False,
        extra="forbid",
        frozen=True,
        validate_default=True,
    )

    backend: str = "auto"
    indexer_backend: Optional[str] = None
    plugins: Annotated[Optional[list[str]], NoDecode] = None
    disable_plugins: Annotated[list[str], NoDecode] = []
    no_plugin_autoload: bool = False
    check_contracts: Literal["first", "always", "never"] = "first"
    check_contents_with_sync: bool = False
    allow_fallback: bool = False
    config: Optional[Path] = None

    _provenance: dict[str, str] = PrivateAttr(default_factory=dict)
    _config_file: Optional[Path] = PrivateAttr(default=None)

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as e:
            try:
                prov = _provenance(type(self), values)
            except ConfigError:
                prov = {}
            raise ConfigError("invalid mm3 settings: " + describe_validation_error(
                e, fields=list(type(self).model_fields), sources=prov, item="setting")) from None
        cfg = _locate_config(values)
        self._provenance = _provenance(type(self), values, cfg)
        for key in ("backend", "indexer_backend"):
            name = getattr(self, key)
            if name is not None and name != "auto":  # frozen model: the validated value, relabelled
                self.__dict__[key] = BackendName(name, self._provenance[key])
        # A discovered pyproject.toml without [tool.mm3] configures nothing: don't claim it.
        used = cfg.explicit or not cfg.pyproject or any(
            src.startswith("file ") for src in self._provenance.values()) or _has_table(cfg)
        self._config_file = cfg.path if used else None

    @field_validator("backend", mode="before")
    @classmethod
    def _backend_name(cls, v: Any) -> Any:
        if v is None or (isinstance(v, str) and not v.strip()):
            return "auto"
        return v.strip() if isinstance(v, str) else v

    @field_validator("indexer_backend", mode="before")
    @classmethod
    def _indexer_name(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip()
            return v or None
        return v

    @field_validator("backend", "indexer_backend")
    @classmethod
    def _identifier(cls, v: Optional[str]) -> Optional[str]:
        import re

        if v is not None and not re.match(_NAME_PATTERN, v):
            raise ValueError(f"{v!r} is not a backend name (letters, digits, underscore; "
                             f"or 'auto'); run `mm3 backends` for the installed names")
        return v

    @field_validator("check_contracts", mode="before")
    @classmethod
    def _guard_mode(cls, v: Any) -> Any:
        # A boolean (pydantic's: true/false, 1/0, yes/no, on/off) is "always"/"never"; empty is unset.
        if isinstance(v, str) and v.strip().lower() in ("", "first", "always", "never"):
            return v.strip().lower() or "first"
        try:
            return "always" if TypeAdapter(bool).validate_python(v) else "never"
        except ValidationError:
            return v

    @field_validator("plugins", mode="before")
    @classmethod
    def _allow_list(cls, v: Any) -> Any:
        if isinstance(v, str) and not v.strip():
            return None
        return _split_names(v)

    @field_validator("disable_plugins", mode="before")
    @classmethod
    def _deny_list(cls, v: Any) -> Any:
        return [] if v is None else _split_names(v)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # No .env files or secret dirs: mm3 reads only what its docs list.
        _check_env(settings_cls)
        init_kwargs = init_settings.init_kwargs if isinstance(init_settings, InitSettingsSource) else {}
        file_source = _file_source(settings_cls, _locate_config(init_kwargs))
        return (init_settings, env_settings) + ((file_source,) if file_source is not None else ())

    # -- provenance -----------------------------------------------------------------------
    @property
    def config_file(self) -> Optional[Path]:
        """The config file that was read (explicit or discovered), or None."""
        return self._config_file

    def sources(self) -> dict[str, str]:
        """Field -> where its value came from: ``"argument"``, ``"env MM3_X"``,
        ``"file PATH"`` (``"file PATH [tool.mm3]"``) or ``"default"``."""
        return dict(self._provenance)


def _has_table(cfg: _ConfigFile) -> bool:
    """True when the pyproject file has a ``[tool.mm3]`` table (even an empty one)."""
    if cfg.path is None:
        return False
    with open(cfg.path, "rb") as f:  # already parsed once by the source, so it is valid TOML
        data = tomllib.load(f)
    return isinstance(data.get("tool"), dict) and "mm3" in data["tool"]


def _provenance(settings_cls: type[BaseSettings], init_kwargs: Mapping[str, Any],
                cfg: Optional[_ConfigFile] = None) -> dict[str, str]:
    """Which source supplies each field, in precedence order, using the same sources."""
    cfg = cfg if cfg is not None else _locate_config(init_kwargs)
    env_values = EnvSettingsSource(settings_cls, case_sensitive=False, env_prefix=ENV_PREFIX)()
    file_source = _file_source(settings_cls, cfg)
    file_values = file_source.toml_data if file_source is not None else {}
    out: dict[str, str] = {}
    for name in settings_cls.model_fields:
        if name in init_kwargs:
            out[name] = "argument"
        elif name in env_values:
            var = next((k for k in os.environ if k.upper() == ENV_PREFIX + name.upper()),
                       ENV_PREFIX + name.upper())
            out[name] = f"env {var}"
        elif name in file_values:
            out[name] = cfg.label
        else:
            out[name] = "default"
    return out


def explain_settings(settings_or_kwargs: Union[Settings, Mapping[str, Any], None] = None
                     ) -> list[tuple[str, Any, str]]:
    """Each effective setting as ``(key, value, source)``, in field order.

    Accepts a :class:`Settings` or the keyword arguments to build one (``None``
    = :func:`default_settings`). ``source`` is ``"argument"``, ``"env MM3_X"``,
    ``"file PATH"`` or ``"default"``.

    Example:
        >>> rows = explain_settings({"backend": "cpu_ref"})
        >>> rows[0]
        ('backend', 'cpu_ref', 'argument')
    """
    if settings_or_kwargs is None:
        settings = default_settings()
    elif isinstance(settings_or_kwargs, Settings):
        settings = settings_or_kwargs
    else:
        settings = Settings(**dict(settings_or_kwargs))
    prov = settings.sources()
    return [(name, getattr(settings, name), prov.get(name, "default")) for name in type(settings).model_fields]


# -- the process's settings -------------------------------------------------------------------

@functools.cache
def default_settings() -> Settings:
    """The settings from the environment and the config file, read once per process.

    Every layer, the registry and the CLI use these unless given a
    :class:`Settings` of their own; reading the environment and the config
    file once means every layer of a model sees the same configuration. After
    changing ``MM3_*`` variables or the config file in-process, call
    :func:`reset_default_settings` (``reset_default_registry()`` does).

    Example:
        >>> default_settings() is default_settings()
        True
    """
    return Settings()


def reset_default_settings() -> None:
    """Forget the process's settings; the next :func:`default_settings` reads them afresh."""
    default_settings.cache_clear()
