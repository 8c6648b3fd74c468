"""Settings: every source, precedence, provenance and every way to get it wrong."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mm3.runtime.config import Settings, explain_settings
from mm3.contract.errors import ConfigError
from mm3.runtime.registry import reset_default_registry

FIELDS = ["backend", "indexer_backend", "plugins", "disable_plugins", "no_plugin_autoload",
          "check_contracts", "check_contents_with_sync", "allow_fallback", "config"]


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No MM3_* variables, and an empty working directory (no mm3.toml / pyproject.toml)."""
    for k in list(os.environ):
        if k.upper().startswith("MM3_"):
            monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def sources(s: Settings) -> dict[str, str]:
    return {k: src for k, _, src in explain_settings(s)}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- defaults and each source ----------------------------------------------------------------------

def test_defaults():
    s = Settings()
    assert (s.backend, s.indexer_backend, s.plugins, s.disable_plugins) == ("auto", None, None, [])
    assert (s.no_plugin_autoload, s.check_contracts, s.allow_fallback, s.config) == (False, "first", False, None)
    assert s.config_file is None
    assert [k for k, _, _ in explain_settings(s)] == FIELDS
    assert set(sources(s).values()) == {"default"}


def test_arguments():
    s = Settings(backend="cuda", plugins=["a"], allow_fallback=True)
    src = sources(s)
    assert (s.backend, s.plugins, s.allow_fallback) == ("cuda", ["a"], True)
    assert src["backend"] == src["plugins"] == src["allow_fallback"] == "argument"
    assert src["indexer_backend"] == "default"


def test_environment_with_comma_lists_and_booleans(monkeypatch):
    monkeypatch.setenv("MM3_BACKEND", "rocm")
    monkeypatch.setenv("MM3_INDEXER_BACKEND", "cpu_ref")
    monkeypatch.setenv("MM3_PLUGINS", "cpu_ref, rocm,,")
    monkeypatch.setenv("MM3_DISABLE_PLUGINS", "cuda")
    monkeypatch.setenv("MM3_NO_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("MM3_CHECK_CONTRACTS", "yes")
    monkeypatch.setenv("MM3_ALLOW_FALLBACK", "true")
    monkeypatch.setenv("MM3_CHECK_CONTENTS_WITH_SYNC", "on")
    s = Settings()
    assert (s.backend, s.indexer_backend) == ("rocm", "cpu_ref")
    assert (s.plugins, s.disable_plugins) == (["cpu_ref", "rocm"], ["cuda"])
    assert s.no_plugin_autoload and s.check_contracts == "always" and s.allow_fallback and s.check_contents_with_sync
    src = sources(s)
    for name in FIELDS[:-1]:
        assert src[name] == f"env MM3_{name.upper()}"


def test_empty_env_values_mean_unset(monkeypatch):
    monkeypatch.setenv("MM3_BACKEND", "")
    monkeypatch.setenv("MM3_INDEXER_BACKEND", "")
    monkeypatch.setenv("MM3_PLUGINS", "")
    monkeypatch.setenv("MM3_CHECK_CONTRACTS", "")
    s = Settings()
    assert (s.backend, s.indexer_backend, s.plugins, s.check_contracts) == ("auto", None, None, "first")


@pytest.mark.parametrize("value, mode", [("first", "first"), ("Always", "always"), ("never", "never"),
                                         ("off", "never"), ("0", "never"), ("on", "always")])
def test_check_contracts_modes_and_booleans(monkeypatch, value, mode):
    monkeypatch.setenv("MM3_CHECK_CONTRACTS", value)
    assert Settings().check_contracts == mode
    assert Settings(check_contracts=mode == "always").check_contracts == ("always" if mode == "always" else "never")


def test_mm3_toml_in_cwd(clean):
    f = write(clean / "mm3.toml", 'backend = "cuda"\ndisable_plugins = ["rocm"]\ncheck_contracts = true\n')
    s = Settings()
    assert (s.backend, s.disable_plugins, s.check_contracts) == ("cuda", ["rocm"], "always")
    assert s.config_file == f
    assert sources(s)["backend"] == f"file {f}"
    assert sources(s)["allow_fallback"] == "default"


def test_lists_in_files_may_be_comma_strings(clean):
    write(clean / "mm3.toml", 'plugins = "a, b"\n')
    assert Settings().plugins == ["a", "b"]


def test_pyproject_tool_mm3_table(clean):
    f = write(clean / "pyproject.toml",
              '[project]\nname = "engine"\n[tool.mm3]\nbackend = "rocm"\nallow_fallback = true\n'
              '[tool.other]\nbackend = "ignored"\n')
    s = Settings()
    assert (s.backend, s.allow_fallback) == ("rocm", True)
    assert s.config_file == f
    assert sources(s)["backend"] == f"file {f} [tool.mm3]"


def test_pyproject_without_table_is_not_a_config_file(clean):
    write(clean / "pyproject.toml", '[project]\nname = "engine"\n[tool.black]\nline-length = 99\n')
    s = Settings()
    assert s.backend == "auto" and s.config_file is None


def test_mm3_toml_wins_over_pyproject(clean):
    write(clean / "pyproject.toml", '[tool.mm3]\nbackend = "rocm"\nallow_fallback = true\n')
    write(clean / "mm3.toml", 'backend = "cuda"\n')
    s = Settings()
    # one file applies; files are not merged
    assert (s.backend, s.allow_fallback) == ("cuda", False)


def test_explicit_config_path_from_env_and_argument(clean, monkeypatch):
    write(clean / "mm3.toml", 'backend = "local"\n')
    env_file = write(clean / "env.toml", 'backend = "from_env_file"\n')
    arg_file = write(clean / "arg.toml", 'backend = "from_arg_file"\n')
    monkeypatch.setenv("MM3_CONFIG", str(env_file))
    s = Settings()
    assert s.backend == "from_env_file" and s.config == env_file and s.config_file == env_file
    assert sources(s)["config"] == "env MM3_CONFIG" and sources(s)["backend"] == f"file {env_file}"
    s = Settings(config=arg_file)
    assert s.backend == "from_arg_file" and sources(s)["config"] == "argument"


def test_explicit_pyproject_path_reads_tool_mm3(clean, monkeypatch):
    sub = clean / "proj"
    sub.mkdir()
    f = write(sub / "pyproject.toml", '[tool.mm3]\nindexer_backend = "cpu_ref"\n')
    monkeypatch.setenv("MM3_CONFIG", str(f))
    assert Settings().indexer_backend == "cpu_ref"


def test_missing_explicit_config_file_is_an_error(clean, monkeypatch):
    monkeypatch.setenv("MM3_CONFIG", str(clean / "nope.toml"))
    with pytest.raises(ConfigError, match="nope.toml.*MM3_CONFIG"):
        Settings()


# -- precedence ----------------------------------------------------------------------------------------

def test_precedence_argument_env_file_default(clean, monkeypatch):
    f = write(clean / "mm3.toml", 'backend = "file_b"\nindexer_backend = "file_i"\n'
                                  'disable_plugins = ["file_d"]\n')
    monkeypatch.setenv("MM3_BACKEND", "env_b")
    monkeypatch.setenv("MM3_INDEXER_BACKEND", "env_i")
    s = Settings(backend="arg_b")
    assert (s.backend, s.indexer_backend, s.disable_plugins, s.plugins) == ("arg_b", "env_i", ["file_d"], None)
    src = sources(s)
    assert src == {**{k: "default" for k in FIELDS}, "backend": "argument",
                   "indexer_backend": "env MM3_INDEXER_BACKEND", "disable_plugins": f"file {f}"}


def test_explain_settings_accepts_kwargs_and_none(monkeypatch):
    monkeypatch.setenv("MM3_CHECK_CONTRACTS", "1")
    rows = dict((k, (v, s)) for k, v, s in explain_settings({"backend": "x"}))
    assert rows["backend"] == ("x", "argument")
    assert rows["check_contracts"] == ("always", "env MM3_CHECK_CONTRACTS")
    assert dict((k, s) for k, _, s in explain_settings())["check_contracts"] == "env MM3_CHECK_CONTRACTS"


# -- errors ------------------------------------------------------------------------------------------------

def test_unknown_key_in_mm3_toml(clean):
    f = write(clean / "mm3.toml", 'backend = "cuda"\nindexer-backend = "x"\n')
    with pytest.raises(ConfigError) as ei:
        Settings()
    msg = str(ei.value)
    assert "'indexer-backend'" in msg and str(f) in msg
    assert "did you mean 'indexer_backend'" in msg and "disable_plugins" in msg


def test_unknown_key_in_pyproject_table(clean):
    f = write(clean / "pyproject.toml", '[tool.mm3]\nbakend = "cuda"\n')
    with pytest.raises(ConfigError, match=r"'bakend'.*pyproject.toml.*did you mean 'backend'"):
        Settings()
    assert f.exists()


def test_config_key_inside_a_file_is_rejected(clean):
    write(clean / "mm3.toml", 'config = "other.toml"\n')
    with pytest.raises(ConfigError, match="'config' cannot be set inside a config file"):
        Settings()


def test_unknown_env_var_suggests_closest(monkeypatch):
    monkeypatch.setenv("MM3_BACKEDN", "cuda")
    with pytest.raises(ConfigError) as ei:
        Settings()
    assert "MM3_BACKEDN" in str(ei.value) and "did you mean MM3_BACKEND" in str(ei.value)


def test_unknown_env_var_without_close_match(monkeypatch):
    monkeypatch.setenv("MM3_ZZZZZZZZZZZZ", "1")
    with pytest.raises(ConfigError, match="MM3_ZZZZZZZZZZZZ.*MM3_ALLOW_FALLBACK"):
        Settings()


@pytest.mark.parametrize("name", ["mm3.toml", "pyproject.toml"])
def test_malformed_toml(clean, name):
    f = write(clean / name, '[tool.mm3]\nbackend = "cuda\n')
    with pytest.raises(ConfigError) as ei:
        Settings()
    msg = str(ei.value)
    assert "malformed TOML" in msg and str(f) in msg and "line 2" in msg


def test_invalid_values_are_config_errors_naming_the_source(clean, monkeypatch):
    monkeypatch.setenv("MM3_ALLOW_FALLBACK", "sometimes")
    with pytest.raises(ConfigError, match="allow_fallback.*env MM3_ALLOW_FALLBACK"):
        Settings()
    monkeypatch.delenv("MM3_ALLOW_FALLBACK")
    write(clean / "mm3.toml", "check_contracts = 3.5\n")
    with pytest.raises(ConfigError, match="check_contracts.*mm3.toml"):
        Settings()
    with pytest.raises(ConfigError, match="not a backend name"):
        Settings(backend="cuda; rm -rf /")


def test_unknown_argument_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown setting 'bakend'.*did you mean 'backend'"):
        Settings(bakend="cuda")


def test_settings_are_frozen():
    s = Settings()
    with pytest.raises(Exception):
        s.backend = "cuda"  # type: ignore[misc]


def test_plugin_and_tool_env_namespaces_are_not_settings(monkeypatch):
    import mm3.runtime.discovery as discovery

    class EP:
        name = "vendorx"

    monkeypatch.setattr(discovery, "list_entry_points", lambda group="mm3.backends": [EP()])
    monkeypatch.setenv("MM3_VENDORX_TUNING", "aggressive")  # a plugin's own knob
    monkeypatch.setenv("MM3_GPU_REPORT", "/tmp/report.jsonl")  # a test-suite knob
    assert Settings().backend == "auto"
    monkeypatch.setenv("MM3_OTHERVENDOR_TUNING", "1")  # no such plugin installed
    with pytest.raises(ConfigError, match="MM3_OTHERVENDOR_TUNING"):
        Settings()


# -- one Settings per process -----------------------------------------------------------------------

def test_layers_share_the_process_settings_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import mm3
    from mm3.runtime import config

    reads: list[int] = []
    real_init = Settings.__init__

    def counting_init(self: Settings, **values: object) -> None:
        reads.append(1)
        real_init(self, **values)

    monkeypatch.setattr(Settings, "__init__", counting_init)
    monkeypatch.setenv("MM3_BACKEND", "cpu_ref")
    p = mm3.SparseAttentionParams.minimax_m3(tp_size=8)
    layers = [mm3.SparseAttention(p, max_num_tokens=8) for _ in range(3)]
    assert len(reads) == 1 and all(layer.settings is config.default_settings() for layer in layers)
    assert layers[0].selection.attention.name == "cpu_ref"

    own = Settings(backend="cpu_ref")                          # a caller's own settings are used as given
    assert mm3.SparseAttention(p, max_num_tokens=8, settings=own).settings is own

    monkeypatch.setenv("MM3_BACKEND", "nosuch")                # changed in-process: stale until reset
    assert mm3.SparseAttention(p, max_num_tokens=8).settings.backend == "cpu_ref"
    reset_default_registry()
    assert config.default_settings().backend == "nosuch"
