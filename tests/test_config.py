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


def test_min_lr_is_a_rate_or_a_share_of_lr():
    """train.min_lr: an absolute rate as before, or "10%" of train.lr (torchtitan's ratio), which the
    schedule decays to; anything else is one line."""
    from petatrain.train.recipe import lr_at

    share = config.load(None, ["train.lr=0.002", "train.min_lr=10%", "train.steps=100", "train.warmup_steps=0"])
    assert share.train.final_lr == pytest.approx(2e-4) and lr_at(99, share.train) == pytest.approx(2e-4, rel=1e-2)
    assert config.load(None, ["train.min_lr=3e-5"]).train.final_lr == 3e-5
    assert config.from_yaml(share.to_yaml(), "x").train.min_lr == "10%"  # recorded as written
    for bad, match in [("lots", "a share of train.lr, 0% to 100%"), ("150%", "0% to 100%"), ("1.0", r"\[0, train.lr")]:
        with pytest.raises(ConfigError, match=match):
            config.load(None, [f"train.min_lr={bad}"])


def test_a_calibration_spread_limit_is_a_share():
    for bad in ("-0.1", ".inf"):
        with pytest.raises(ConfigError, match=r"plan\.calibration_max_spread must be a share >= 0"):
            config.load(None, [f"plan.calibration_max_spread={bad}"])
