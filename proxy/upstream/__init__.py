"""The upstreams the proxy sends to: admission (slots), replicas and placement, retries and their
budget, health checks, DNS discovery, and one exchange per upstream request.
"""
