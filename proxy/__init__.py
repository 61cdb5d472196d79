"""n-proxy: gives OpenAI ``n > 1`` to LLM servers that serve one choice per request.

A request with ``n = k`` becomes ``k`` concurrent ``n = 1`` children upstream, and their answers
are stitched into the one a server with native ``n`` sends (docs/behaviour.md). The package is
built in layers; each imports only the layers below it, and only through their faces: the names
each layer's ``__init__`` lists in ``__all__`` (``tests/meta/test_layers.py``)::

    cli                 the ``n-proxy`` command
    devserver/          the demo backend: an n = 1-only server shaped like vLLM's
    server/             the process: the app, listeners and client connections, reload, drain,
                        workers
    request/            one client request: handler, pass-through, fan-out, writing to the client
    upstream/           the upstreams: admission (slots), replicas, retries, health, exchanges
    http/               the HTTP/1.1 client: connections, responses, the pool (no aiohttp)
    observe/            metrics, the log, traces, the census of what is held
    config/             the YAML file's models, validated once at load
    core/               pure: planning, SSE, stitching, templates, usage, headers, errors

``core`` does no I/O: bytes and dicts in, bytes and dicts out. The I/O shell around it is
``http`` (the only code that talks to an upstream), ``request`` and ``server`` (the only code
that talks to a client).
"""

__version__ = "0.1.0"
