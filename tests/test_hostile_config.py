"""Configs and failures a careless or hostile user can produce: each ends in one line that
names the key, and no secret from a config is written anywhere."""

import json

import pytest

from conftest import run_cli
from petatrain import config
from petatrain.errors import ConfigError

KEY_ID = "AKIAEXAMPLEKEYID4242"
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


def _with_credentials(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "storage:\n"
        "  s3_endpoint_url: http://127.0.0.1:9000\n"
        f"  s3_access_key_id: {KEY_ID}\n"
        f"  s3_secret_access_key: {SECRET}\n"
    )
    return path


def test_credentials_reach_storage_but_no_written_config(tmp_path):
    cfg = config.load(_with_credentials(tmp_path))
    options = cfg.storage.options()
    assert (options.s3_access_key_id, options.s3_secret_access_key) == (KEY_ID, SECRET)
    # config.yaml is cfg.to_yaml(); the run_start event and the workers' payload carry cfg.to_dict()
    for text in (cfg.to_yaml(), json.dumps(cfg.to_dict()), repr(cfg), repr(cfg.storage)):
        assert SECRET not in text and KEY_ID not in text
    assert cfg.to_dict()["storage"]["s3_endpoint_url"] == "http://127.0.0.1:9000"


def test_a_written_config_loads_again_with_credentials_from_the_environment(tmp_path):
    written = tmp_path / "config.yaml"
    written.write_text(config.load(_with_credentials(tmp_path)).to_yaml())
    again = config.load(written).storage
    assert (again.s3_access_key_id, again.s3_secret_access_key) == ("", "")  # AWS_* / credential chain


def test_petatrain_config_prints_no_credentials(tmp_path):
    path = _with_credentials(tmp_path)
    for extra in ([], ["--json"]):
        result = run_cli("config", str(path), *extra)
        assert result.returncode == 0, result.stderr[-1000:]
        assert SECRET not in result.stdout + result.stderr and KEY_ID not in result.stdout + result.stderr


def test_a_malformed_secret_is_not_echoed_in_the_error():
    with pytest.raises(ConfigError, match=r"storage\.s3_secret_access_key") as err:
        config.load(None, [f"storage.s3_secret_access_key=[{SECRET}]"])
    assert SECRET not in str(err.value)
