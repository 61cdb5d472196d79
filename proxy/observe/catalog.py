"""The model names a metric label may carry (docs/operating.md#tokens): the names the config's
routes give, and the names each upstream reports, in its answers' ``model`` and in the model
lists the proxy reads from it; at most ``PER_UPSTREAM`` of them per upstream, learned first come.
Any other model is ``OTHER``, so that a client choosing model names cannot grow the series.
"""

from __future__ import annotations

from collections.abc import Iterable

PER_UPSTREAM = 32  # names learned from one upstream; later ones are OTHER
OTHER = "other"
_GLOB = frozenset("*?[")
MAX_NAME = 200  # a longer name is no model's label


class ModelCatalog:
    def __init__(self) -> None:
        self._configured: set[str] = set()
        self._learned: dict[str, set[str]] = {}  # upstream -> the names it reported

    def configure(self, names: Iterable[str | None]) -> None:
        """The names a config gives (its routes' ``model``): a glob names no model."""
        self._configured.update(
            n for n in names if n and len(n) <= MAX_NAME and not _GLOB.intersection(n)
        )

    def learn(self, upstream: str, names: Iterable[str]) -> None:
        """Names ``upstream`` reported, kept while it has reported fewer than ``PER_UPSTREAM``."""
        known = self._learned.setdefault(upstream, set())
        for name in names:
            if len(known) >= PER_UPSTREAM:
                return
            if name and len(name) <= MAX_NAME:
                known.add(name)

    def knows(self, upstream: str, name: str | None) -> bool:
        if name is None:
            return False
        return name in self._configured or name in self._learned.get(upstream, ())

    def label(self, upstream: str, answered: str | None, asked: str | None) -> str:
        """The label of a request to ``upstream`` that asked for model ``asked`` and was answered
        by ``answered`` (the upstream's own name for it, learned here first): the answer's name
        when known, else the asked one when known, else ``OTHER``."""
        if answered is not None:
            known = self._learned.get(upstream)
            if (known is not None and answered in known) or answered in self._configured:
                return answered  # the common case, on every answer: no call
            self.learn(upstream, (answered,))
            if self.knows(upstream, answered):
                return answered
        return asked if asked is not None and self.knows(upstream, asked) else OTHER
