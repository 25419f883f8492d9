"""A Claude-Code-shaped agent session: the requests Claude Code would send,
built from its own captured request (``tests/fixtures/agents/claude_code_messages.json``),
and the tools it would run, simulated over an in-memory workspace.

Every request carries the captured system blocks (the billing line first,
with a fresh ``cch`` nonce each request, as the CLI sends it), the
environment description as a ``role: "system"`` message after the first
user message, and the captured tools (12: Bash, Read, Edit, Write, ...).
The user's turns ask to read a source file, edit it (a rename), write a new
file copying a function from it, run a command, and follow up; after a tool
call the tool's result goes back as Claude Code sends it (``Read`` in
``cat -n`` form, Edit's and Write's confirmations and errors in its words,
Bash's output simulated), and the model answers again.

``short``: a trimmed request for development (the system prompt and the
environment description cut, only Read, Edit, Write and Bash) that keeps
the shape and prefills in seconds rather than minutes.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "agents" / "claude_code_messages.json"
#: The working directory of the captured session (its environment description names it).
WORKDIR = "/tmp/hf2q-agent-capture/work"
#: The billing line as the CLI sends it; ``cch`` changes on every request.
BILLING = "x-anthropic-billing-header: cc_version=2.1.328.05a; cc_entrypoint=cli; cch={nonce};"
SHORT_TOOLS = ("Read", "Edit", "Write", "Bash")
#: In the short session: characters kept of the long system block and of the environment.
SHORT_SYSTEM, SHORT_ENVIRONMENT = 1200, 700


@dataclass
class Shape:
    """What every request carries besides the conversation."""

    system: list[dict[str, Any]]  # the system blocks after the billing line
    reminder: str  # the first user message's <system-reminder> text block
    environment: str  # the role: "system" message's text
    tools: list[dict[str, Any]]
    extra: dict[str, Any]  # thinking, output_config, context_management, metadata


def claude_code_shape(short: bool = False) -> Shape:
    """The captured request's parts; ``short``: trimmed for development."""
    body = json.loads(FIXTURE.read_text(encoding="utf-8"))["body"]
    system = copy.deepcopy(body["system"][1:])
    environment = body["messages"][1]["content"][0]["text"]
    tools = copy.deepcopy(body["tools"])
    if short:
        system[-1]["text"] = system[-1]["text"][:SHORT_SYSTEM]
        environment = environment[:SHORT_ENVIRONMENT]
        tools = [t for t in tools if t["name"] in SHORT_TOOLS]
    extra = {
        k: copy.deepcopy(body[k]) for k in ("thinking", "output_config", "context_management", "metadata")
    }
    return Shape(system, body["messages"][0]["content"][0]["text"], environment, tools, extra)


# -- the workspace and its tools ----------------------------------------------------------------
def cat_n(text: str, offset: int = 1, limit: int | None = None) -> str:
    """A file as Claude Code's Read returns it: ``cat -n`` lines (the number
    right-aligned in 6 columns, a tab, the line)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    start = max(offset, 1)
    chosen = lines[start - 1 : None if limit is None else start - 1 + limit]
    return "\n".join(f"{start + i:>6}\t{line}" for i, line in enumerate(chosen))


@dataclass
class Workspace:
    """Files by absolute path, and the session's canned command outputs."""

    files: dict[str, str]
    commands: dict[str, str] = field(default_factory=dict)

    def path(self, name: Any) -> str:
        name = str(name or "")
        return name if name.startswith("/") else f"{WORKDIR}/{name}"

    def run(self, name: str, args: dict[str, Any]) -> tuple[str, bool]:
        """A tool call's result text and whether it is an error, as Claude Code answers."""
        tool = getattr(self, f"_{name.lower()}", None)
        if tool is None:
            return f"<tool_use_error>No such tool available: {name}</tool_use_error>", True
        return tool(args)

    def _read(self, args: dict[str, Any]) -> tuple[str, bool]:
        path = self.path(args.get("file_path"))
        if path not in self.files:
            return f"File does not exist. Note: your current working directory is {WORKDIR}.", True
        offset, limit = args.get("offset"), args.get("limit")
        return cat_n(self.files[path], int(offset) if offset else 1, int(limit) if limit else None), False

    def _edit(self, args: dict[str, Any]) -> tuple[str, bool]:
        path = self.path(args.get("file_path"))
        old, new = str(args.get("old_string", "")), str(args.get("new_string", ""))
        if path not in self.files:
            return f"<tool_use_error>File does not exist. Note: your current working directory is {WORKDIR}.</tool_use_error>", True  # fmt: skip
        if old == new:
            return "<tool_use_error>No changes to make: old_string and new_string are exactly the same.</tool_use_error>", True  # fmt: skip
        text = self.files[path]
        found = text.count(old) if old else 0
        if found == 0:
            return (
                f"<tool_use_error>String to replace not found in file.\nString: {old}</tool_use_error>",
                True,
            )
        if found > 1 and not args.get("replace_all"):
            return (
                f"<tool_use_error>Found {found} matches of the string to replace, but replace_all is false. "
                "To replace all occurrences, set replace_all to true. To replace only one occurrence, please "
                f"provide more context to uniquely identify the instance.\nString: {old}</tool_use_error>"
            ), True
        self.files[path] = text.replace(old, new) if args.get("replace_all") else text.replace(old, new, 1)
        return f"The file {path} has been updated successfully.", False

    def _write(self, args: dict[str, Any]) -> tuple[str, bool]:
        path = self.path(args.get("file_path"))
        existed = path in self.files
        self.files[path] = str(args.get("content", ""))
        if existed:
            return f"The file {path} has been updated successfully.", False
        return f"File created successfully at: {path}", False

    def _bash(self, args: dict[str, Any]) -> tuple[str, bool]:
        command = " ".join(str(args.get("command", "")).split())
        for known, output in self.commands.items():
            if known in command:
                return output, False
        return "(Bash completed with no output)", False


# -- the session --------------------------------------------------------------------------------
SOURCE = '''"""A small inventory of items with quantities and prices."""

from dataclasses import dataclass


@dataclass
class Item:
    name: str
    quantity: int
    price: float


def total_value(items):
    """Return the total value of all items."""
    total = 0.0
    for item in items:
        total += item.quantity * item.price
    return total


def find_item(items, name):
    """Return the item with the given name, or None."""
    for item in items:
        if item.name == name:
            return item
    return None


def restock(items, name, amount):
    """Add amount to the quantity of the named item."""
    item = find_item(items, name)
    if item is None:
        raise KeyError(name)
    item.quantity += amount
    return item


def low_stock(items, threshold=5):
    """Return the names of items whose quantity is below threshold."""
    return [item.name for item in items if item.quantity < threshold]
'''
SOURCE_PATH = f"{WORKDIR}/inventory.py"
#: What the simulated shell prints for a command containing the key; any other prints nothing
#: (report.py, holding a copied function, prints nothing when run).
COMMANDS: dict[str, str] = {}
#: The user's turns, in order.
TURNS = (
    ("read", "Read inventory.py with the Read tool."),
    ("edit: rename", "Rename find_item to lookup_item in inventory.py with the Edit tool."),
    ("write: new file", "Create report.py with the Write tool, with a copy of total_value from inventory.py."),
    ("follow-up: rename", "Rename restock to refill in inventory.py with the Edit tool."),
    ("follow-up: rename again", "Rename low_stock to short_items in inventory.py with the Edit tool."),
    ("bash: run", "Use the Bash tool to run python3 report.py."),
)  # fmt: skip
#: Requests per user turn at most: the model calls a tool, then answers once it has the result
#: (a call in that answer has its result sent with the next user message).
MAX_REQUESTS_PER_TURN = 2

#: The file of the finished exchange the session opens with.
EXAMPLE_PATH = f"{WORKDIR}/math_ops.py"
EXAMPLE_SOURCE = '''def mul(a, b):
    """Return the product of a and b."""
    return a * b


def square(x):
    """Return x times itself."""
    return mul(x, x)
'''
_MUL = EXAMPLE_SOURCE.split("\n\n\n")[0]
_SQUARE = EXAMPLE_SOURCE.split("\n\n\n")[1]
#: (user's text, the assistant's call (name, input), its text after the result)
EXAMPLE = (
    ("Read math_ops.py with the Read tool.", ("Read", {"file_path": EXAMPLE_PATH}),
     "math_ops.py defines mul, the product of two numbers, and square, which uses it."),
    ("Rename mul to times in math_ops.py with the Edit tool.",
     ("Edit", {"file_path": EXAMPLE_PATH, "old_string": _MUL, "new_string": _MUL.replace("def mul", "def times")}),
     "Renamed mul to times."),
    ("Create helpers.py with the Write tool, with a copy of square from math_ops.py.",
     ("Write", {"file_path": f"{WORKDIR}/helpers.py", "content": _SQUARE}),
     "Created helpers.py with square."),
)  # fmt: skip


def workspace() -> Workspace:
    return Workspace({SOURCE_PATH: SOURCE, EXAMPLE_PATH: EXAMPLE_SOURCE}, dict(COMMANDS))


def fingerprint(shape: Shape) -> str:
    """A digest of everything the session's requests are made of (the shape,
    the opening, the turns, the files): a recorded conversation made from
    other parts does not match."""
    import hashlib

    parts = [shape.system, shape.reminder, shape.environment, shape.tools, shape.extra, EXAMPLE, EXAMPLE_SOURCE,
             SOURCE, TURNS, COMMANDS, BILLING, MAX_REQUESTS_PER_TURN]  # fmt: skip
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def billing_block(index: int, seed: int = 0) -> dict[str, Any]:
    """The billing line of request ``index``: its own 5-hex nonce."""
    nonce = random.Random(seed * 1_000_003 + index).getrandbits(20)
    return {"type": "text", "text": BILLING.format(nonce=f"{nonce:05x}")}


def first_user(shape: Shape, prompt: str) -> list[dict[str, Any]]:
    """The first user message and the environment message after it, as the CLI sends them."""
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": shape.reminder}, {"type": "text", "text": prompt}],
        },
        {"role": "system", "content": [{"type": "text", "text": shape.environment}]},
    ]


def opening(shape: Shape, space: Workspace) -> list[dict[str, Any]]:
    """The session so far: a finished exchange on another file (read it, an
    edit that copies a function with a rename, a new file copying another),
    its tools run on ``space``. A 0.5B model given Claude Code's prompt alone
    writes edits without the code they change (``old_string`` just a name, a
    Write without content); with an exchange before, as agents give small
    models, it copies."""
    messages: list[dict[str, Any]] = []
    for i, (prompt, (name, args), after) in enumerate(EXAMPLE):
        messages += first_user(shape, prompt) if not messages else [{"role": "user", "content": prompt}]
        call = [{"type": "tool_use", "id": f"toolu_e{i + 1}", "name": name, "input": args}]
        messages += [
            {"role": "assistant", "content": call},
            {"role": "user", "content": tool_results(space, call)},
        ]
        messages.append({"role": "assistant", "content": [{"type": "text", "text": after}]})
    return messages


def run_session(shape: Shape, ask, max_tokens: int, log=print, turns: int | None = None) -> dict[str, Any]:
    """The session driven by ``ask(body) -> (text, calls, record)``: the
    opening, then each user turn (the first ``turns``); every request's
    messages and answer."""
    space = workspace()
    messages, requests, pending, next_id = opening(shape, space), [], [], 1
    for label, prompt in TURNS[:turns]:
        messages.append({"role": "user", "content": pending + [{"type": "text", "text": prompt}]})
        pending = []
        for step in range(MAX_REQUESTS_PER_TURN):
            text, calls, record = ask(request_body(shape, messages, len(requests), max_tokens))
            blocks = assistant_blocks(text, calls, next_id)
            next_id += len(calls)
            name = label if step == 0 else f"{label} / after the result"
            requests.append({"label": name, "messages": len(messages), "answer": record})
            log(f"{name}: {[c['name'] for c in calls]} {text[:200]!r}")
            messages.append({"role": "assistant", "content": blocks or [{"type": "text", "text": ""}]})
            if not calls:
                break
            results = tool_results(space, blocks)
            if step + 1 == MAX_REQUESTS_PER_TURN:
                pending = results
            else:
                messages.append({"role": "user", "content": results})
    return {"messages": messages, "requests": requests}


def request_body(
    shape: Shape, messages: list[dict[str, Any]], index: int, max_tokens: int, stream: bool = True
) -> dict[str, Any]:
    """Request ``index`` of the session: Claude Code's body, greedy."""
    return {
        "model": "claude-opus-5-5",
        "max_tokens": max_tokens,
        "system": [billing_block(index), *copy.deepcopy(shape.system)],
        "messages": copy.deepcopy(messages),
        "tools": copy.deepcopy(shape.tools),
        "stream": stream,
        "temperature": 0,
        **copy.deepcopy(shape.extra),
    }


def tool_results(space: Workspace, content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The user message answering an assistant message's tool_use blocks."""
    out = []
    for block in content:
        if block.get("type") == "tool_use":
            text, error = space.run(block["name"], block.get("input") or {})
            out.append(
                {"type": "tool_result", "tool_use_id": block["id"], "content": text, "is_error": error}
            )
    return out


def assistant_blocks(text: str, calls: list[dict[str, Any]], first_id: int) -> list[dict[str, Any]]:
    """An answer as the content blocks the client keeps: its text, then its
    calls with ids numbered from ``first_id`` (the same on every server)."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text.strip() else []
    for i, c in enumerate(calls):
        blocks.append({"type": "tool_use", "id": f"toolu_{first_id + i:02d}", "name": c["name"], "input": c["arguments"]})  # fmt: skip
    return blocks


def openai_request(body: dict[str, Any], model: str = "default_model") -> dict[str, Any]:
    """A Messages request as a proxy sends it on to chat completions: the
    system blocks joined (billing line included, as sent), blocks to chat
    messages as hf2q-py's own Messages API reads them, calls' arguments as
    JSON text, tools as functions; ``model``: the name the server answers to
    (mlx_lm.server loads any other name it is given)."""
    from hf2q_py.server.anthropic_protocol import MessagesRequest, conversation

    conv = conversation(MessagesRequest.model_validate({**body, "stream": False}))
    messages = []
    for m in conv.messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
                    },
                }  # fmt: skip
                for c in m["tool_calls"]
            ]
            m["content"] = m.get("content") or None
        messages.append(m)
    return {
        "model": model,
        "messages": messages,
        "tools": conv.tools,
        "max_tokens": body["max_tokens"],
        "temperature": 0,
        "stream": body.get("stream", True),
    }
