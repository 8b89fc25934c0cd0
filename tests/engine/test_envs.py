"""`kvpilot.envs`: the registry of environment variables and its one boolean parser."""

from pathlib import Path

import pytest

from kvpilot import envs


@pytest.mark.parametrize("raw, want", [("1", True), ("true", True), ("TRUE", True), ("Yes", True), ("on", True),
                                       (" On ", True), ("0", False), ("false", False), ("False", False),
                                       ("NO", False), ("off", False)])
def test_parse_bool_accepts_the_eight_spellings_in_any_case(raw, want):
    assert envs.parse_bool("KVPILOT_X", raw) is want


@pytest.mark.parametrize("raw", ["", "2", "enable", "nope", "y", "-1"])
def test_parse_bool_rejects_anything_else_naming_the_variable(raw):
    with pytest.raises(ValueError, match="KVPILOT_X"):
        envs.parse_bool("KVPILOT_X", raw)


def test_registry_is_small_and_documented():
    assert len(envs.REGISTRY) <= 8
    for name, var in envs.REGISTRY.items():
        assert name.startswith("KVPILOT_") and var.name == name
        assert var.doc and var.kind in ("str", "path", "float", "json")


def test_defaults_when_unset_or_empty(monkeypatch):
    for name in envs.REGISTRY:
        monkeypatch.delenv(name, raising=False)
    assert envs.api_key() is None
    assert envs.cpu_kv_cache_bytes() == 4 << 30
    assert envs.dist_timeout_s() == 600.0
    assert envs.cache_dir() == Path.home() / ".cache" / "kvpilot"
    assert envs.tuning_json() is None
    monkeypatch.setenv("KVPILOT_CPU_KVCACHE_GB", "")
    assert envs.cpu_kv_cache_bytes() == 4 << 30


def test_values_are_parsed_when_read(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPILOT_CPU_KVCACHE_GB", "0.5")
    assert envs.cpu_kv_cache_bytes() == 1 << 29
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path))
    assert envs.cache_dir() == tmp_path
    monkeypatch.setenv("KVPILOT_DIST_TIMEOUT_S", "30")
    assert envs.dist_timeout_s() == 30.0
    monkeypatch.setenv("KVPILOT_API_KEY", "secret")
    assert envs.api_key() == "secret"


@pytest.mark.parametrize("name, raw", [("KVPILOT_CPU_KVCACHE_GB", "four"), ("KVPILOT_CPU_KVCACHE_GB", "-1"),
                                       ("KVPILOT_DIST_TIMEOUT_S", "0")])
def test_bad_numbers_name_the_variable(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=name):
        envs.get(name)


def test_unregistered_names_are_refused():
    with pytest.raises(KeyError):
        envs.get("KVPILOT_CUDA_GRAPHS")
    with pytest.raises(KeyError):
        envs.external("KVPILOT_API_KEY")

