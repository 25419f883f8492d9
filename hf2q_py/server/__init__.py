"""``hf2q-py serve``: an OpenAI-compatible HTTP server over one Target.

protocol.py  OpenAI's request models (pydantic) and response bodies
worker.py    the one owner of the model: jobs, one at a time, cancellable
app.py       the routes, the error contract, body limit and API key
metrics.py   Prometheus metrics
main.py      binding the port, the HTTP thread, signals
"""

from __future__ import annotations

from .app import ServerConfig, create_app
from .main import serve

__all__ = ["ServerConfig", "create_app", "serve"]
