"""A deterministic OpenAI-compatible n=1-only backend, shaped like vLLM's server.

It serves the README demo, the test suite and the benchmarks, and can inject faults per request.
"""

from proxy.devserver.app import build_app, start_devserver
from proxy.devserver.cli import main
from proxy.devserver.config import DEV_CONFIG, DevConfig
from proxy.devserver.faults import (
    ERROR_EVENT,
    FAULT_CAP_SECONDS,
    FAULTS,
    HUGE_WORD,
    MID_STREAM_FAULTS,
    STATUS_FAULTS,
    Knobs,
    shape_generation,
)
from proxy.devserver.generation import SSE_HEADERS
from proxy.devserver.model import (
    STOP_MIN_MAX_TOKENS,
    STOP_PROBABILITY,
    WORD_TOKENS,
    WORDS,
    Generation,
    Token,
    generate,
    top_tokens,
)
from proxy.devserver.reply import SYSTEM_FINGERPRINT, TOKEN_IDS, Answer, TokensAnswer
from proxy.devserver.request import (
    DEFAULT_MAX_TOKENS,
    MAX_TOP_LOGPROBS,
    Job,
    RequestError,
    parse_generate_job,
    parse_job,
)
from proxy.devserver.responses import ERROR_TYPES
from proxy.devserver.state import DEV_STATE, HISTORY, DevState, Outcome

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEV_CONFIG",
    "DEV_STATE",
    "ERROR_EVENT",
    "ERROR_TYPES",
    "FAULTS",
    "FAULT_CAP_SECONDS",
    "HISTORY",
    "HUGE_WORD",
    "MAX_TOP_LOGPROBS",
    "MID_STREAM_FAULTS",
    "SSE_HEADERS",
    "STATUS_FAULTS",
    "STOP_MIN_MAX_TOKENS",
    "STOP_PROBABILITY",
    "SYSTEM_FINGERPRINT",
    "TOKEN_IDS",
    "WORDS",
    "WORD_TOKENS",
    "Answer",
    "DevConfig",
    "DevState",
    "Generation",
    "Job",
    "Knobs",
    "Outcome",
    "RequestError",
    "Token",
    "TokensAnswer",
    "build_app",
    "generate",
    "main",
    "parse_generate_job",
    "parse_job",
    "shape_generation",
    "start_devserver",
    "top_tokens",
]
