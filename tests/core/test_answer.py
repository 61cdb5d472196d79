"""What a passed-through answer says of itself (proxy.core.answer): literal bytes in, its usage,
id and model out, from a whole JSON body or from the last bytes of a stream or a body."""

from __future__ import annotations

import pytest

from proxy.core.answer import NOTHING, AnswerFacts, answer_facts
from proxy.core.usage import Tokens, token_counts

USAGE = b'{"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}'
FACTS = AnswerFacts({"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}, "c-1", "m")
CHUNK = b'data: {"id": "c-1", "model": "m", "choices": [{"index": 0, "delta": {"content": "x"}}]}'
USAGE_CHUNK = b'data: {"id": "c-1", "model": "m", "choices": [], "usage": ' + USAGE + b"}"


@pytest.mark.parametrize(
    ("data", "facts"),
    [
        (b'{"id": "c-1", "model": "m", "choices": [], "usage": ' + USAGE + b"}", FACTS),
        (b'  {"id": "c-1", "model": "m", "usage": ' + USAGE + b"}\n", FACTS),
        # A stream's tail: the usage chunk, then [DONE]; LF or CRLF line ends.
        (CHUNK + b"\n\n" + USAGE_CHUNK + b"\n\ndata: [DONE]\n\n", FACTS),
        (CHUNK + b"\r\n\r\n" + USAGE_CHUNK + b"\r\n\r\ndata: [DONE]\r\n\r\n", FACTS),
        # The tail begins inside an event: that line does not parse and is passed over.
        (b'ent": "x"}}]}\n\n' + USAGE_CHUNK + b"\n\ndata: [DONE]\n\n", FACTS),
        # Whole chunks written on as they came: the chunked framing between the events.
        (
            b"%x\r\n" % (len(USAGE_CHUNK) + 2) + USAGE_CHUNK + b"\n\n\r\ne\r\ndata: [DONE]\n\n\r\n",
            FACTS,
        ),
        # Usage on every chunk (vLLM's continuous usage stats): the last one counts.
        (
            USAGE_CHUNK.replace(b"7", b"1").replace(b"12", b"6") + b"\n\n" + USAGE_CHUNK + b"\n\n",
            FACTS,
        ),
        # A stream that sent no usage: its id and model, no usage.
        (CHUNK + b"\n\ndata: [DONE]\n\n", AnswerFacts(None, "c-1", "m")),
        (b'data: {"choices": [], "usage": null}\n\n', NOTHING),
        # The end of a JSON body too large to be held whole.
        (
            b'"logprob": -0.5}]}}], "usage": ' + USAGE + b', "kv_transfer_params": null}',
            AnswerFacts(FACTS.usage),
        ),
        # vLLM's generate endpoint names its answer request_id.
        (
            b'{"request_id": "generate-tokens-r", "choices": [], "usage": ' + USAGE + b"}",
            AnswerFacts(FACTS.usage, "generate-tokens-r"),
        ),
        (b"", NOTHING),
        (b"not json at all", NOTHING),
        (b'{"usage": "many"}', NOTHING),
        (b"[1, 2]", NOTHING),
        (b'data: {"usage": {"prompt_tokens": 1', NOTHING),
    ],
)
def test_an_answers_usage_id_and_model_are_read_from_its_bytes(
    data: bytes, facts: AnswerFacts
) -> None:
    assert answer_facts(data) == facts


def test_a_tail_cut_anywhere_says_no_more_than_it_holds() -> None:
    """However the start of the tail falls, nothing raises, and a usage found is the real one."""
    whole = CHUNK + b"\n\n" + USAGE_CHUNK + b"\n\ndata: [DONE]\n\n"
    for at in range(len(whole) + 1):
        facts = answer_facts(whole[at:])
        assert facts.usage in (None, FACTS.usage)
        if at <= len(CHUNK) + 2:
            assert facts == FACTS


@pytest.mark.parametrize(
    ("usage", "tokens"),
    [
        ({"prompt_tokens": 5, "completion_tokens": 7}, Tokens(5, 7, 0, 0)),
        (
            {
                "prompt_tokens": 9,
                "completion_tokens": 20,
                "prompt_tokens_details": {"cached_tokens": 4},
                "completion_tokens_details": {"reasoning_tokens": 11},
            },
            Tokens(9, 20, 4, 11),
        ),
        ({"prompt_tokens": True, "completion_tokens": 2.5}, Tokens(0, 0, 0, 0)),
        ({"prompt_tokens_details": None, "completion_tokens_details": []}, Tokens(0, 0, 0, 0)),
        ({}, Tokens(0, 0, 0, 0)),
    ],
)
def test_the_tokens_a_usage_reports(usage: dict[str, object], tokens: Tokens) -> None:
    assert token_counts(usage) == tokens
