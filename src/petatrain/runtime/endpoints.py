"""A run's endpoints beside its ledger: the Prometheus metrics (and the file that tells Prometheus
where they are) and the driver's health endpoint (`runtime.health`)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from petatrain.config import JobConfig
from petatrain.errors import ConfigError
from petatrain.runtime.hub.handle import HubHandle
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import atomic_write, resolve

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Endpoints:
    metrics: str | None  # the metrics' URL, None without one
    health: str  # the health endpoint's URL, "" without one


def open_endpoints(
    hub: HubHandle,
    cfg: JobConfig,
    run_url: str,
    run_id: str,
    options: StorageOptions | None,
    held: contextlib.ExitStack,
) -> Endpoints:
    """Publish the hub's metrics endpoint for Prometheus and serve the health endpoint until `held` closes."""
    metrics = hub.call("metrics_url")
    publish_targets(run_url, run_id, metrics, options)
    if metrics:
        log.info("metrics: %s", metrics)
    health = _health_server(hub, cfg)
    if health is None:
        return Endpoints(metrics, "")
    held.callback(health.close)
    log.info("health: %s/livez, %s/readyz", health.url, health.url)
    return Endpoints(metrics, health.url)


def publish_targets(run_url: str, run_id: str, metrics: str | None, options: StorageOptions | None) -> None:
    """Write the metrics endpoint into `RUN/prometheus/targets.json`, the file Prometheus'
    `file_sd_configs` reads (labels run_id, run_dir); with no endpoint, remove it."""
    from petatrain.observe.metrics import TARGETS_FILE, file_sd_targets

    url = join(run_url, TARGETS_FILE)
    try:
        if metrics:
            atomic_write(url, file_sd_targets(metrics, {"run_id": run_id, "run_dir": run_url}), options)
            return
        fs, path = resolve(url, options)
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(path)
    except Exception as exc:  # discovery is a convenience: the run and its ledger do not depend on it
        log.warning("could not %s %s: %s", "write" if metrics else "remove", url, exc)


def last_scrape(hub: HubHandle, linger_s: float) -> None:
    """Keep the ended run's metrics up until Prometheus has scraped them once more (if it scrapes
    them at all), at most `linger_s`: else the final goodput dies with the run, unseen."""
    if linger_s <= 0:
        return
    try:
        hub.call("last_scrape", linger_s, timeout=linger_s + 10)
    except KeyboardInterrupt:  # the run is over; a person who stops the wait loses only that scrape
        log.info("stopped waiting for the metrics' last scrape")
    except Exception:
        log.debug("waiting for the metrics' last scrape failed", exc_info=True)


def _health_server(hub: HubHandle, cfg: JobConfig) -> Any:
    """The driver's /livez and /readyz (runtime.health), or None when observe.health_host is ""."""
    if not cfg.observe.health_host:
        return None
    from petatrain.runtime.health import HealthServer

    try:
        return HealthServer(hub.actor, cfg.observe.health_host, cfg.observe.health_port, cfg.observe.health_window_s)
    except OSError as exc:
        where = f"{cfg.observe.health_host}:{cfg.observe.health_port}"
        raise ConfigError(
            f"observe.health_host/health_port: cannot serve the health endpoint on {where}: {exc}"
        ) from None
