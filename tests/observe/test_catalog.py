"""The model names a metric label may carry (proxy.observe.catalog): the config's, and those an
upstream reports, a bounded number of them; any other is "other"."""

from __future__ import annotations

from proxy.observe.catalog import OTHER, PER_UPSTREAM, ModelCatalog


def test_the_configs_names_are_labels_and_its_globs_are_not() -> None:
    catalog = ModelCatalog()
    catalog.configure(["llama-3", "qwen-*", None, "x" * 201])
    assert catalog.label("u", None, "llama-3") == "llama-3"
    assert catalog.label("u", None, "qwen-*") == OTHER
    assert catalog.label("u", None, "qwen-7b") == OTHER
    assert catalog.label("u", None, "x" * 201) == OTHER


def test_the_answers_model_is_learned_per_upstream_and_wins_over_the_asked_one() -> None:
    catalog = ModelCatalog()
    assert catalog.label("u", "served-name", "alias") == "served-name"
    assert catalog.label("u", None, "served-name") == "served-name"  # learned: a label now
    assert catalog.label("v", None, "served-name") == OTHER  # another upstream's name
    assert catalog.label("u", None, None) == OTHER


def test_an_upstream_teaches_at_most_its_share_of_names() -> None:
    catalog = ModelCatalog()
    labels = {catalog.label("u", f"model-{i}", None) for i in range(PER_UPSTREAM * 3)}
    assert labels == {f"model-{i}" for i in range(PER_UPSTREAM)} | {OTHER}
    catalog.learn("u", ["listed-late"])  # a model list after the share is full: not a label
    assert catalog.label("u", None, "listed-late") == OTHER
    catalog.learn("v", ["listed"])
    assert catalog.label("v", None, "listed") == "listed"
