"""The n-proxy benchmark: n-proxy beside direct, nginx, aiohttp forwarders and LiteLLM on loopback.
``python -m bench`` (bench/README.md); nothing here is imported by the proxy."""
