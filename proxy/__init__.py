"""n-proxy: gives OpenAI ``n > 1`` to LLM servers that serve one choice per request."""

__version__ = "0.1.0"
