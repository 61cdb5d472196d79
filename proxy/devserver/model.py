"""The deterministic generation model: words drawn from a PRNG seeded by (prompt, seed).

Pure: no I/O, no request parsing, no response shapes.
"""

from __future__ import annotations

import hashlib
import random
import secrets
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

WORDS = (
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
    "juliett", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
    "sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu",
)  # fmt: skip
WORD_TOKENS = tuple(" " + word for word in WORDS)
# Early stops only for long generations, so short test answers always have a known length.
STOP_MIN_MAX_TOKENS = 32
STOP_PROBABILITY = 1 / 8


@dataclass(frozen=True)
class Token:
    text: str
    logprob: float


@dataclass(frozen=True)
class Generation:
    tokens: tuple[Token, ...]
    finish_reason: str
    key: int  # the PRNG seed; also seeds the top-logprob alternatives

    @cached_property
    def offsets(self) -> list[int]:
        return list(accumulate((len(t.text) for t in self.tokens), initial=0))


def generate(prompt: str, seed: int | None, max_tokens: int, may_stop: bool) -> Generation:
    """Words drawn from a PRNG seeded by sha256(prompt, seed); no seed or -1 is fresh randomness.

    Every position draws the same numbers whatever happens, so a shorter answer is a prefix of a
    longer one.
    """
    if seed is None or seed == -1:
        key = secrets.randbits(64)
    else:
        digest = hashlib.sha256(f"{prompt}\x00{seed}".encode()).digest()
        key = int.from_bytes(digest[:8], "big")
    rng = random.Random(key)
    tokens: list[Token] = []
    finish_reason = "length"
    for position in range(max_tokens):
        text = rng.choice(WORD_TOKENS)
        logprob = -round(0.01 + 2.99 * rng.random(), 4)
        if rng.random() < STOP_PROBABILITY and may_stop and position >= 1:
            finish_reason = "stop"
            break
        tokens.append(Token(text, logprob))
    return Generation(tuple(tokens), finish_reason, key)


def top_tokens(gen: Generation, position: int, k: int) -> list[Token]:
    """The k most likely tokens at `position`: the sampled one, then lower-ranked words."""
    if k <= 0:
        return []
    chosen = gen.tokens[position]
    rng = random.Random(f"{gen.key}:{position}")
    others = rng.sample([w for w in WORD_TOKENS if w != chosen.text], min(k, len(WORDS)) - 1)
    tops = [chosen]
    for text in others:
        tops.append(Token(text, round(tops[-1].logprob - 0.05 - rng.random(), 4)))
    return tops
