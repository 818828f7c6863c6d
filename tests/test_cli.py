"""The CLI as a newcomer meets it: help on every verb, the demo end to end."""

import json

import pytest

from conftest import run_cli


@pytest.mark.parametrize("verb", ["ingest", "inspect", "demo", "config"])
def test_every_verb_has_help(verb):
    result = run_cli(verb, "--help")
    assert result.returncode == 0 and "Usage" in result.stdout


def test_demo_ingests_streams_and_resumes_exactly_once(tmp_path):
    result = run_cli("demo", "--root", str(tmp_path), "--documents", "400", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["inspect"]["verified"] is True
    assert report["ingest"]["exact_duplicates"] > 0 and sum(report["ingest"]["rejected"].values()) > 0
    stream = report["stream"]
    assert stream["exactly_once"] and stream["ranks_before"] == 2 and stream["ranks_after"] == 3
    assert stream["consumed_before"] + stream["consumed_after"] == stream["samples_in_epoch"]
    again = run_cli("demo", "--root", str(tmp_path), "--documents", "400", "--json")
    assert json.loads(again.stdout)["ingest"]["files_new"] == 0, "a second demo run ingests nothing new"
