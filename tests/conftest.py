import hf2q_py  # noqa: F401  first, so OpenBLAS is loaded before mlx.core as users get it
import pytest


@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load fails the test: the error must come before it."""

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(hf2q_py, "load", refuse)
