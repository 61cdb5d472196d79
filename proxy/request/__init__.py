"""One client request: the handler that decides, the pass-through relay, the fan-out and its stream
writer, and the answers the proxy writes itself.
"""
