"""The pure core: planning children, SSE, stitching, byte templates, usage, the header and JSON
rules, the proxy's errors. No I/O: bytes and dicts in and out.
"""
