"""What the proxy tells its operator: Prometheus metrics, the log, OpenTelemetry traces, and the
census of what it holds.
"""
