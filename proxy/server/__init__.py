"""The process: the aiohttp app, the listeners and client connections, the admin endpoints, drain on
SIGTERM, workers and memory.
"""
