"""dblock's metrics, exported for Prometheus to scrape.

OpenTelemetry's SDK with its Prometheus exporter, set up once at start-up as
any application sets up OpenTelemetry; dblock reports through the global
providers by itself (its ``telemetry`` option defaults to on when
``opentelemetry-api`` is installed). Run it, then read
http://127.0.0.1:9464/metrics::

    pip install '.[otel]' opentelemetry-sdk opentelemetry-exporter-prometheus
    python examples/metrics/prometheus_app.py --port 9464 --seconds 30
"""

from __future__ import annotations

import argparse
import threading
import time

from opentelemetry import metrics
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import start_http_server

from dblock import LockManager, LockNotAcquired


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="database URL (default: $DBLOCK_URL or SQLite)")
    parser.add_argument("--port", type=int, default=9464)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()

    # What an application does once: the SDK, a reader, the global provider.
    start_http_server(port=args.port, addr="127.0.0.1")
    metrics.set_meter_provider(MeterProvider(metric_readers=[PrometheusMetricReader()]))

    locks = LockManager(args.url)
    locks.create_schema()

    def work(worker: int) -> None:
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            try:
                with locks.lock(f"user:{worker % 3}", timeout=0.5):
                    time.sleep(0.01)
            except LockNotAcquired:
                pass

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    print(f"serving metrics on http://127.0.0.1:{args.port}/metrics", flush=True)
    for t in threads:
        t.join()
    locks.close()


if __name__ == "__main__":
    main()
