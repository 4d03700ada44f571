"""Metrics from every service: OpenTelemetry instruments, on a Prometheus endpoint always, over OTLP when set.

    from crucible.shared import metrics
    TOKENS = metrics.counter("crucible.generator.tokens", "tokens sampled", "{token}")
    TOKENS.add(n, {"backend": "torch"})

`setup_metrics(service, settings)` (called by service.setup) installs the meter provider with a
pull reader that renders the Prometheus text format on http://<metrics_host>:<port>/metrics, the
port being `metrics_port` (0: any free one; the port chosen is logged). Instruments made before
setup (module level) are bound to the provider once it exists: the OTel API's proxy meter.
A port that is taken costs the endpoint, never the service.
"""
from __future__ import annotations

import logging
import math
import os
import re
import threading

from opentelemetry import metrics as otel_metrics
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider, ObservableCounter, ObservableGauge, \
    ObservableUpDownCounter, UpDownCounter
from opentelemetry.sdk.metrics.export import AggregationTemporality, Gauge, MetricReader, MetricsData, Sum
from opentelemetry.sdk.metrics.export import Histogram as HistogramData
from opentelemetry.sdk.resources import Resource

from crucible.shared.http_server import BoundedThreadingHTTPServer, RequestHandler
from crucible.shared.settings import Settings

log = logging.getLogger(__name__)
_meter = otel_metrics.get_meter("crucible")
_server: BoundedThreadingHTTPServer | None = None
METRICS_CONNECTIONS = 16  # scrapers: Prometheus, a collector, a person with curl
METRICS_IDLE_S = 10.0


def counter(name: str, description: str = "", unit: str = ""):
    return _meter.create_counter(name, unit=unit, description=description)


def histogram(name: str, description: str = "", unit: str = ""):
    return _meter.create_histogram(name, unit=unit, description=description)


def gauge(name: str, callback, description: str = "", unit: str = ""):
    """An observable gauge: `callback(options)` yields opentelemetry.metrics.Observation values when scraped."""
    return _meter.create_observable_gauge(name, callbacks=[callback], unit=unit, description=description)


class PrometheusReader(MetricReader):
    """A pull reader: each scrape collects the provider's metrics and renders them as Prometheus text."""

    def __init__(self):
        cumulative = AggregationTemporality.CUMULATIVE
        super().__init__(preferred_temporality={Counter: cumulative, UpDownCounter: cumulative, Histogram: cumulative,
                                                ObservableCounter: cumulative, ObservableUpDownCounter: cumulative,
                                                ObservableGauge: cumulative})
        self._latest: MetricsData | None = None
        self._lock = threading.Lock()

    def _receive_metrics(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> None:
        self._latest = metrics_data

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass

    def render(self) -> str:
        with self._lock:
            self._latest = None
            self.collect()
            return render(self._latest)


def _name(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_:]", "_", name)


def _labels(attributes, extra: dict[str, str] | None = None) -> str:
    pairs = {**{_name(str(k)): str(v) for k, v in dict(attributes or {}).items()}, **(extra or {})}
    if not pairs:
        return ""
    escaped = (f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34)).replace(chr(10), " ")}"'
               for k, v in sorted(pairs.items()))
    return "{" + ",".join(escaped) + "}"


def _number(value: float) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


def render(data: MetricsData | None) -> str:
    """Prometheus text exposition (version 0.0.4) of collected OTel metrics."""
    lines: list[str] = []
    for resource_metrics in (data.resource_metrics if data else []):
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                name, points = _name(metric.name), metric.data.data_points
                if isinstance(metric.data, Sum):
                    kind = "counter" if metric.data.is_monotonic else "gauge"
                    name = f"{name}_total" if metric.data.is_monotonic and not name.endswith("_total") else name
                elif isinstance(metric.data, Gauge):
                    kind = "gauge"
                elif isinstance(metric.data, HistogramData):
                    kind = "histogram"
                else:
                    continue
                if metric.description:
                    lines.append(f"# HELP {name} {metric.description.replace(chr(10), ' ')}")
                lines.append(f"# TYPE {name} {kind}")
                for point in points:
                    if kind != "histogram":
                        lines.append(f"{name}{_labels(point.attributes)} {_number(point.value)}")
                        continue
                    running = 0
                    for bound, count in zip([*point.explicit_bounds, math.inf], point.bucket_counts):
                        running += count
                        lines.append(f"{name}_bucket{_labels(point.attributes, {'le': _number(float(bound))})} {running}")
                    lines.append(f"{name}_sum{_labels(point.attributes)} {_number(point.sum)}")
                    lines.append(f"{name}_count{_labels(point.attributes)} {point.count}")
    return "\n".join(lines) + "\n"


def setup_metrics(service_name: str, settings: Settings) -> int | None:
    """Installs the meter provider and serves /metrics; returns the port served (None: no endpoint)."""
    global _server
    if _server is not None:
        return _server.server_address[1]
    reader = PrometheusReader()
    readers: list[MetricReader] = [reader]
    endpoint = settings.otel_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    if endpoint:
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        if settings.otel_protocol == "http":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            exporter = OTLPMetricExporter(endpoint=f"{endpoint.rstrip('/')}/v1/metrics")
        else:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            exporter = OTLPMetricExporter(endpoint=endpoint, insecure=True)
        readers.append(PeriodicExportingMetricReader(exporter, export_interval_millis=10_000))
    resource = Resource.create({"service.name": service_name, "service.namespace": "crucible"})
    otel_metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))

    class Handler(RequestHandler):
        timeout = METRICS_IDLE_S  # each read and write of a connection (a half-sent request held a thread for ever)

        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404, "only /metrics is served here")
                return
            body = reader.render().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # scrapes are not news
            pass

    try:
        # Bounded: k8s and compose serve it on every interface, and a thread per connection without a cap
        # gave anyone reaching the port a thread and a descriptor of every service per connection.
        _server = BoundedThreadingHTTPServer((settings.metrics_host, settings.metrics_port), Handler,
                                             METRICS_CONNECTIONS)
    except OSError as exc:
        log.warning("no metrics endpoint: %s:%d: %s", settings.metrics_host, settings.metrics_port, exc)
        return None
    threading.Thread(target=_server.serve_forever, name="metrics", daemon=True).start()
    port = _server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", settings.metrics_host, port)
    if settings.metrics_port_file:
        settings.metrics_port_file.parent.mkdir(parents=True, exist_ok=True)
        settings.metrics_port_file.write_text(str(port))
    return port
