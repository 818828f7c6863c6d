"""The run's Prometheus endpoint, fed by every event the hub writes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from petatrain.observe.events import Event


class Server(Protocol):
    """What the hub uses of `observe.metrics.MetricsServer`."""

    host: str
    port: int

    @property
    def last_scrape(self) -> float | None: ...

    def observe(self, event: Event) -> None: ...

    def wait_for_scrape(self, after: float, timeout_s: float) -> bool: ...

    def close(self) -> None: ...


class Metrics:
    """The endpoint, where observe.metrics_host asks for one (bound to 127.0.0.1 by default); without
    one, every call does nothing."""

    SCRAPE_ANSWER_S = 0.2  # after the last scrape read the values: for its answer to reach the scraper

    def __init__(
        self, server: Server | None, clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep
    ):
        self.server, self.clock, self.sleep = server, clock, sleep

    @classmethod
    def serve(cls, host: str, port: int) -> Metrics:
        """Serving on `host:port`, or no endpoint where `host` is ""."""
        from petatrain.observe.metrics import MetricsServer

        return cls(MetricsServer(host, port) if host else None)

    def observe(self, event: Event) -> None:
        if self.server is not None:
            self.server.observe(event)

    def url(self, node_ip: Callable[[], str]) -> str | None:
        """Where Prometheus reaches the metrics: an endpoint on every interface is named by `node_ip()`."""
        if self.server is None:
            return None
        host = self.server.host
        if host in ("0.0.0.0", "::"):
            host = node_ip()
        return f"http://{f'[{host}]' if ':' in host else host}:{self.server.port}/metrics"

    def last_scrape(self, max_s: float) -> bool:
        """Once the run's end is in the metrics: wait, at most `max_s`, for a scrape to read them, if
        anything scrapes this endpoint at all; whether one did."""
        server = self.server
        if server is None or max_s <= 0 or server.last_scrape is None:
            return False
        scraped = server.wait_for_scrape(self.clock(), max_s)
        if scraped:
            self.sleep(
                self.SCRAPE_ANSWER_S
            )  # the values are read; let the answer reach the scraper before the port closes
        return scraped

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
