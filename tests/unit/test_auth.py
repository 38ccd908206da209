"""The API key check both front doors (HTTP and gRPC) share."""

from __future__ import annotations

import argparse
import pickle
import re

import pytest

from tessera.cluster.auth import bearer, expected_authorization, key_matches
from tessera.cluster.cluster_config import ConfigError
from tessera.cluster.flags import add_config_arguments, config_from_args
from tessera.cluster.serve_config import MAX_KEY_FILE_CHARS, ServeConfig


def test_a_request_must_present_bearer_and_the_key():
    expected = expected_authorization("s3cret")
    assert expected == b"Bearer s3cret"
    assert key_matches(expected, bearer("s3cret"))
    assert not key_matches(expected, "s3cret")  # the scheme is part of the value
    assert not key_matches(expected, "Bearer s3cre")
    assert not key_matches(expected, "Bearer s3cret ")
    assert not key_matches(expected, "Bearer sécret")  # non-ASCII: refused, no error


def test_no_key_means_open_access():
    assert expected_authorization(None) is None
    assert expected_authorization("") is None


def test_the_key_is_a_secret_that_no_repr_or_log_shows(monkeypatch):
    monkeypatch.delenv("TESSERA_API_KEY", raising=False)
    config = ServeConfig.create(api_key="s3cret-k3y")
    assert "s3cret-k3y" not in repr(config) and "s3cret-k3y" not in str(config)
    assert "s3cret-k3y" not in repr(config.model_dump())
    assert expected_authorization(config.api_key) == b"Bearer s3cret-k3y"
    assert pickle.loads(pickle.dumps(config)).api_key.get_secret_value() == "s3cret-k3y"


def test_the_key_is_read_from_a_file_or_the_environment(monkeypatch, tmp_path):
    """``--api-key-file`` and ``$TESSERA_API_KEY`` keep the key out of ``ps``; a flag
    or setting wins over the environment, the file over the environment too."""
    monkeypatch.setenv("TESSERA_API_KEY", "from-env")
    path = tmp_path / "key"
    path.write_text("  from-file\n")
    assert ServeConfig.create(api_key_file=str(path)).api_key.get_secret_value() == "from-file"
    assert ServeConfig.create().api_key.get_secret_value() == "from-env"
    for text, message in [
        ("", "is empty"),
        ("two words", "must hold one key"),
        ("k" * (MAX_KEY_FILE_CHARS + 1), "must hold one key"),
    ]:
        path.write_text(text)
        with pytest.raises(
            ConfigError, match=f"^api_key_file: {re.escape(repr(str(path)))} {message}"
        ):
            ServeConfig.create(api_key_file=str(path))
    with pytest.raises(ConfigError, match="^api_key_file: cannot read .*No such file"):
        ServeConfig.create(api_key_file=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="^api_key_file: give api_key or api_key_file, not both"):
        ServeConfig.create(api_key="k", api_key_file=str(path))


def test_the_key_file_flag_reaches_the_config(monkeypatch, tmp_path):
    monkeypatch.delenv("TESSERA_API_KEY", raising=False)
    path = tmp_path / "key"
    path.write_text("flag-k3y\n")
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, ServeConfig)
    args = parser.parse_args(["--api-key-file", str(path)])
    assert config_from_args(args, ServeConfig).api_key.get_secret_value() == "flag-k3y"
