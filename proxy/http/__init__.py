"""The upstream HTTP/1.1 client: one connection per request in flight, the response read or relayed
from the protocol, keep-alive pooling. It knows nothing of LLMs, n or replicas, and imports no
aiohttp.
"""
