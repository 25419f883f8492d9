import os

# No test reaches the internet: hub names resolve from the (empty) cache unless a test
# starts its stand-in hub (tests/hub_server.py) and says otherwise. Set before anything
# imports huggingface_hub, which reads them once.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"  # nothing listens there

import hf2q_py  # noqa: E402, F401  first, so OpenBLAS is loaded before mlx.core as users get it
import pytest  # noqa: E402


@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load fails the test: the error must come before it."""

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(hf2q_py, "load", refuse)
