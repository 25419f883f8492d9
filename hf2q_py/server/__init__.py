"""``hf2q-py serve``: an HTTP server over one Target speaking OpenAI's chat and
text completions and Anthropic's Messages API, one engine under them.

conversation.py        the neutral request (Conversation) and the prompt's making
engine.py              a conversation to a worker job, its output to neutral events
events.py              the events and the pipeline (reasoning split -> tool split)
call_split.py          content and tool calls as they are written
tool_calls.py          tool-call formats, tool_choice, whole-call parsing
openai_api.py          OpenAI's chat and text completions (protocol.py: its models)
anthropic_api.py       Anthropic's Messages API (anthropic_protocol.py: its models)
worker.py              the one owner of the model: jobs batched by a scheduler, cancellable
app.py, guard.py       the routes, errors in each API's envelope, body limit and API key
metrics.py             Prometheus metrics
main.py                binding the port, the HTTP thread, signals; follow (a sharded target's other ranks)
relay.py               a sharded target's step news, from rank 0's worker to the others'
"""

from __future__ import annotations

from .app import ServerConfig, create_app
from .main import serve

__all__ = ["ServerConfig", "create_app", "serve"]
