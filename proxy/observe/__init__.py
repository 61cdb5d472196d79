"""What the proxy tells its operator: Prometheus metrics, the log, OpenTelemetry traces, and the
census of what it holds.
"""

from proxy.observe.census import Census, UpstreamCensus
from proxy.observe.clienterrors import ClientErrors, kind_of, lacks_version
from proxy.observe.line import RequestLine
from proxy.observe.log import LEVELS, log_event, logger, setup_logging
from proxy.observe.meter import RequestMetrics
from proxy.observe.metrics import MULTIPROCESS, Metrics
from proxy.observe.record import ChildRecord, LargeRequest, Observer, Observers, RequestRecord
from proxy.observe.tracing import Tracing, tracing_from_env

__all__ = [
    "LEVELS",
    "MULTIPROCESS",
    "Census",
    "ChildRecord",
    "ClientErrors",
    "LargeRequest",
    "Metrics",
    "Observer",
    "Observers",
    "RequestLine",
    "RequestMetrics",
    "RequestRecord",
    "Tracing",
    "UpstreamCensus",
    "kind_of",
    "lacks_version",
    "log_event",
    "logger",
    "setup_logging",
    "tracing_from_env",
]
