import pytest

from petatrain import config
from petatrain.errors import ConfigError


def test_defaults_build_and_round_trip_through_yaml(tmp_path):
    cfg = config.load()
    path = tmp_path / "job.yaml"
    path.write_text(cfg.to_yaml())
    assert config.load(path) == cfg


def test_yaml_and_set_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  steps: 10\ningest:\n  dedup: exact\n")
    cfg = config.load(path, ["train.steps=250", "ingest.near_threshold=0.9", "storage.s3_region=eu-west-1"])
    assert cfg.train.steps == 250
    assert cfg.ingest.dedup == "exact"
    assert cfg.ingest.near_threshold == 0.9
    assert cfg.storage.options().s3_region == "eu-west-1"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.stepz=3"], "unknown config key 'train.stepz'"),
        (["nosuch.key=1"], "unknown config key 'nosuch'"),
        (["train.steps=many"], "train.steps: expected a number"),
        (["ingest.dedup=fuzzy"], "ingest.dedup: 'fuzzy' is not one of none, exact, near"),
        (["ingest.near_threshold=1.5"], "ingest.near_threshold must be in (0, 1)"),
        (["ingest.shard_size=huge"], "ingest.shard_size: cannot read size 'huge'"),
        (["ingest.pack_length=128"], "ingest.pack_length needs ingest.tokenizer"),
        (["train.steps"], "expected KEY=VALUE"),
    ],
)
def test_bad_config_names_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        config.load(None, overrides)
    assert message in str(err.value)


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model:\n  kind: gpt\n  layers: 4\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.layers'"):
        config.load(path)


def test_sizes():
    assert config.parse_size("256MB") == 256_000_000
    assert config.parse_size("1GiB") == 2**30
    assert config.parse_size("4096") == 4096
