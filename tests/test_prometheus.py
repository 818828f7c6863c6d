"""A training run scraped by a real Prometheus (Debian's `prometheus`, installed here if missing),
which finds the run through the file_sd target file the run writes, and reads the final goodput
after the run's end: the endpoint stays up until that last scrape."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import requests
import yaml

from helpers import ROOT, tiny, train
from petatrain.observe.ledger import read_events
from petatrain.observe.metrics import TARGETS_FILE, MetricsServer
from ray_head import free_ports


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    """Debian's Prometheus, installed with apt-get when it is not on PATH (as tests/s3server/rgw.sh installs Ceph)."""
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.fail("prometheus is not installed, and installing it needs root and apt-get: apt-get install prometheus")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=600", "-qq"]
    for args in (["update"], ["install", "-y", "--no-install-recommends", "prometheus"]):
        done = subprocess.run([*apt, *args], capture_output=True, text=True, env=env, timeout=900)
        if done.returncode != 0:
            pytest.fail(f"apt-get {args[0]} failed:\n{done.stderr[-2000:]}")
    found = shutil.which("prometheus")
    assert found, "prometheus still not on PATH after apt-get install prometheus"
    return found


@contextlib.contextmanager
def prometheus(binary: str, folder, targets_glob: str, scrape_s: int = 1):
    """A Prometheus on 127.0.0.1 scraping every target its file_sd glob finds; yields its URL."""
    port = free_ports(1)[0]
    config = {
        "global": {"scrape_interval": f"{scrape_s}s", "scrape_timeout": f"{scrape_s}s"},
        "scrape_configs": [
            {"job_name": "petatrain", "file_sd_configs": [{"files": [targets_glob], "refresh_interval": "1s"}]}
        ],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    argv = [
        binary, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]  # fmt: skip
    with (folder / "prometheus.log").open("wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            assert server.poll() is None, (folder / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "Prometheus did not become ready in 60 s"
            time.sleep(0.3)
        yield url
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def final_goodput(events: list[dict]) -> float:
    """What the endpoint serves once the run's last event is in: the events fed to a MetricsServer."""
    with MetricsServer() as replay:
        for event in events:
            replay.observe(event)
        value = replay.registry.get_sample_value("petatrain_goodput")
    assert value is not None
    return value


@pytest.mark.slow  # a training run on Ray and a Prometheus server
def test_prometheus_finds_the_run_and_scrapes_its_final_goodput_after_it_ends(
    prometheus_binary, token_dataset, tmp_path
):
    run = tmp_path / "run"
    glob = str(run / os.path.dirname(TARGETS_FILE) / "*.json")
    with prometheus(prometheus_binary, tmp_path, glob) as server:
        # Long enough to be scraped while it runs (an endpoint nothing scraped closes at once): the
        # run's prometheus/ folder does not exist when Prometheus starts, and its file discovery
        # found it only after the 5 s that 60 steps took in the full suite (its log: "Error adding
        # file watch ... no such file"). 250 steps take 5-20 s.
        train(tiny(token_dataset, "train.steps=250", "checkpoint.every=50", "observe.metrics_linger_s=20"), run)
        events = read_events(str(run))
        start, end = events[0], events[-1]
        assert start["event"] == "run_start" and end["event"] == "end" and end["status"] == "ok"
        query = f'petatrain_goodput{{run_id="{start["run_id"]}",run_dir="{run}"}}[5m]'
        # The run ended once a scrape had read its final values; Prometheus stores a scrape's samples
        # after it has read the whole answer, so the query may come a moment before they are in.
        deadline = time.monotonic() + 10
        while True:
            answer = requests.get(f"{server}/api/v1/query", params={"query": query}, timeout=10).json()
            if answer.get("data", {}).get("result") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        panels = dashboard_queries(**{"$run_id": start["run_id"], "$__range": "5m"})
        # Asked at the last scrape: a warm 250-step run may end within a second of the first one.
        last = max((float(v[0]) for s in answer["data"]["result"] for v in s["values"]), default=end["t"])
        answers = {}
        for title, expr in panels:
            asked = {"query": expr, "time": str(last)}
            got = requests.get(f"{server}/api/v1/query", params=asked, timeout=10).json()
            if answers.get(title, {}).get("data", {}).get("result"):
                continue  # a panel shows data when one of its queries has some
            answers[title] = got
    assert answer["status"] == "success", answer
    (series,) = answer["data"]["result"]
    assert series["metric"]["job"] == "petatrain"
    stamp, value = series["values"][-1]
    # Prometheus dates a sample when its scrape starts; the endpoint counted it as the last one only
    # if it read the values after the end was in, so its value is the run's final goodput.
    assert float(value) == pytest.approx(final_goodput(events), abs=1e-12)
    assert float(stamp) >= end["t"] - 1.0
    assert len(series["values"]) >= 2  # scraped while it ran, too
    # The dashboard's training panels show this run, as Prometheus answered at its last scrape of it.
    empty = {"Faults by cause", "Pipeline stages idle (bubble)"}  # no fault, no pipeline here
    for title, expr in panels:
        if "ray_" in expr:
            continue  # serving: Ray's endpoint, not this run's
        assert title in answers and answers[title]["status"] == "success", (title, answers.get(title))
        assert bool(answers[title]["data"]["result"]) == (title not in empty), (title, expr)
    assert not (run / TARGETS_FILE).exists()  # the endpoint is gone, and so is the target naming it


DASHBOARD = ROOT / "examples" / "grafana" / "petatrain.json"
_GRAFANA = {"$__rate_interval": "1m", "$__range": "1h", "$run_id": ".*", "$model": ".*"}


def dashboard_queries(**values: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the dashboard, Grafana's variables filled in."""
    board = json.loads(DASHBOARD.read_text())
    found = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in {**_GRAFANA, **values}.items():
                expr = expr.replace(name, value)
            found.append((panel["title"], expr))
    return found


def exported_metrics() -> set[str]:
    """Every series name petatrain exports: the driver's endpoint (its registry, as scraped) and the
    serving replicas' Ray metrics (ray_ prefixed; counters _total, histograms _bucket/_sum/_count)."""
    names = set()
    with MetricsServer() as server:
        for family in server.registry.collect():
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    source = (ROOT / "src" / "petatrain" / "serve" / "app.py").read_text()
    suffixes = {"Counter": ["_total"], "Gauge": [""], "Histogram": ["_bucket", "_sum", "_count"]}
    for kind, name in re.findall(r'metrics\.(Counter|Gauge|Histogram)\(\s*"(\w+)"', source):
        names |= {f"ray_{name}{suffix}" for suffix in suffixes[kind]}
    return names


def test_the_grafana_dashboard_asks_only_for_what_petatrain_exports_in_valid_promql(tmp_path, prometheus_binary):
    """examples/grafana/petatrain.json: every panel's query names series the code exports (a renamed
    metric fails here, not in a user's empty panel), and promtool parses each as PromQL."""
    board = json.loads(DASHBOARD.read_text())
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "run_id", "model"}
    queries = dashboard_queries()
    exported = exported_metrics()
    assert {"petatrain_goodput", "ray_petatrain_model_staleness_seconds"} <= exported
    for title, expr in queries:
        used = set(re.findall(r"\b(?:ray_)?petatrain_\w+", expr))
        assert used and used <= exported, f"{title}: {sorted(used - exported)} not exported"
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"panel:{i}", "expr": expr} for i, (_, expr) in enumerate(queries)
    ]}]}  # fmt: skip
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    # Debian's prometheus package brings promtool (the fixture installs it: `make test-fast` runs no other test of it)
    promtool = shutil.which("promtool") or pytest.fail("promtool is not beside Debian's prometheus")
    checked = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
