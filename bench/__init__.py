"""The n-proxy benchmark: direct, nginx, n-proxy and LiteLLM side by side on loopback.

Run it with ``bench/run`` (see bench/README.md); nothing here is imported by the proxy.
"""
