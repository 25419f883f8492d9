"""The real agent CLIs, as their users run them, pointed at a server by its base URL.

``scripts/setup.sh`` installs them from npm, pinned by ``tests/agents/package.json``
and its lock file, into ``tests/agents/node_modules`` (skipped, with a note, where
``npm`` is absent). Each run gets its own home and config directories under a
temporary folder, so no run reads or writes the user's, and a working directory
holding ``note.txt``. Every switch a CLI has for telemetry, update checks and other
traffic besides the model's is set: with them, each CLI talks only to the base URL
(checked with strace when the fixtures were captured, ``tests/agent_recorder.py``).

A session is one prompt. In a tool round trip the model calls the client's own tool
on ``note.txt`` (``AgentClient.tool_call``), the client runs it and sends the result
back, and the model's next answer ends the turn.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AGENTS = Path(__file__).resolve().parent / "agents"
BIN = AGENTS / "node_modules" / ".bin"
NOTE = "note.txt"
PROMPT = "Read note.txt and tell me what it says."
API_KEY = "sk-hf2q-test"
#: What the environment keeps from the caller's: nothing that names an account or a key.
KEPT = ("PATH", "LANG", "LC_ALL", "TZ", "SYSTEMROOT")
#: A client's command-line arguments (before the prompt) and environment variables.
Configured = tuple[list[str], dict[str, str]]


@dataclass(frozen=True)
class Call:
    """A tool call as the model writes it: a tool of the client's, its arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Setup:
    """One run's command line, environment and folders."""

    argv: list[str]
    env: dict[str, str]
    home: Path
    workdir: Path


@dataclass(frozen=True)
class AgentClient:
    """One agent CLI: its npm package, the API it speaks, how it is pointed at a
    server, the tool call that reads ``note.txt`` with its own tools, and how its
    final answer and the tool's output are read from what it prints."""

    name: str
    package: str
    binary: str
    route: str  # the server's endpoint it posts to
    fixture: str  # its first agent request, under tests/fixtures/agents/
    tool_call: Callable[[Path], Call]  # the working directory -> the call
    configure: Callable[[Path, Path, str, str], Configured]  # home, workdir, base URL, model
    answer: Callable[[str], str]  # stdout -> the final answer it printed
    tool_output: Callable[[str], str]  # stdout -> the tool's output it reported
    follow_up: str | None = None  # the request after the tool result, saved too
    preface: str | None = None  # a request without tools it sends before the agent's, saved too

    def missing(self) -> str | None:
        """Why this client cannot run here, or None."""
        if shutil.which("npm") is None and not (BIN / self.binary).exists():
            return "npm is not installed, so scripts/setup.sh installed no agent CLIs"
        if not (BIN / self.binary).exists():
            return f"{self.package} is not installed: run scripts/setup.sh (npm install in tests/agents)"
        return None

    def version(self) -> str:
        path = AGENTS / "node_modules" / self.package / "package.json"
        return json.loads(path.read_text())["version"]

    def setup(self, root: Path, base_url: str, model: str, note: str, prompt: str = PROMPT) -> Setup:
        """Folders under ``root`` (a home, a temporary folder, a working directory holding ``note.txt``
        with ``note``) and the command line that runs one prompt against ``base_url``."""
        home, workdir, tmp = root / "home", root / "work", root / "tmp"
        for folder in (home, workdir, tmp):
            folder.mkdir(parents=True, exist_ok=True)
        (workdir / NOTE).write_text(note)
        env = {k: os.environ[k] for k in KEPT if k in os.environ}
        env.update(
            HOME=str(home),
            XDG_CONFIG_HOME=str(home / ".config"),
            XDG_DATA_HOME=str(home / ".local" / "share"),
            XDG_STATE_HOME=str(home / ".local" / "state"),
            XDG_CACHE_HOME=str(home / ".cache"),
            TMPDIR=str(tmp),  # Claude Code and Codex keep sockets and scratch folders there
            TERM="dumb",
            NO_COLOR="1",
        )
        args, extra = self.configure(home, workdir, base_url, model)
        env.update(extra)
        return Setup([str(BIN / self.binary), *args, prompt], env, home, workdir)


@dataclass
class Run:
    """What one run of a client did."""

    setup: Setup
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False
    seconds: float = 0.0


def run(setup: Setup, timeout: float) -> Run:
    """Run the client once, stdin closed, in a session of its own: killed whole on
    timeout, and whatever it left running is ended when it exits."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        setup.argv,
        cwd=setup.workdir,
        env=setup.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return Run(setup, proc.returncode, out, err, timed_out, time.monotonic() - t0)


def _json_lines(stdout: str) -> list[dict[str, Any]]:
    events = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def _text(content: Any) -> str:
    """Text of a tool result or message content: a string, or a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(p.get("text", p.get("content", ""))) for p in content if isinstance(p, dict))
    return ""


# -- qwen-code ---------------------------------------------------------------------------------
def _qwen_configure(home: Path, workdir: Path, base_url: str, model: str) -> Configured:
    settings = {
        "general": {"enableAutoUpdate": False},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False},
    }
    (home / ".qwen").mkdir(exist_ok=True)
    (home / ".qwen" / "settings.json").write_text(json.dumps(settings, indent=2))
    env = {"OPENAI_BASE_URL": f"{base_url}/v1", "OPENAI_API_KEY": API_KEY, "OPENAI_MODEL": model}
    return ["--auth-type", "openai", "--output-format", "json", "-p"], env


def _qwen_answer(stdout: str) -> str:
    events = _qwen_events(stdout)
    results = [e for e in events if e.get("type") == "result"]
    return results[-1].get("result", "") if results else ""


def _qwen_events(stdout: str) -> list[dict[str, Any]]:
    text = stdout.strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return _json_lines(stdout)
    return value if isinstance(value, list) else [value]


def _qwen_tool_output(stdout: str) -> str:
    out = []
    for event in _qwen_events(stdout):
        message = event.get("message") if isinstance(event.get("message"), dict) else {}
        for part in message.get("content") or []:
            if isinstance(part, dict) and part.get("type") == "tool_result":
                out.append(_text(part.get("content")))
    return "\n".join(out)


QWEN_CODE = AgentClient(
    name="qwen-code",
    package="@qwen-code/qwen-code",
    binary="qwen",
    route="/v1/chat/completions",
    fixture="qwen_code_chat.json",
    tool_call=lambda workdir: Call("read_file", {"file_path": str(workdir / NOTE)}),
    configure=_qwen_configure,
    answer=_qwen_answer,
    tool_output=_qwen_tool_output,
)


# -- opencode ----------------------------------------------------------------------------------
def opencode_config(base_url: str, model: str) -> dict[str, Any]:
    """opencode's config: an OpenAI-compatible provider at ``base_url``, no autoupdate, no sharing."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "provider": {
            "hf2q": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "hf2q-py",
                "options": {"baseURL": f"{base_url}/v1", "apiKey": API_KEY},
                "models": {model: {"name": model}},
            }
        },
        "model": f"hf2q/{model}",
    }


def _opencode_configure(home: Path, workdir: Path, base_url: str, model: str) -> Configured:
    folder = home / ".config" / "opencode"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "opencode.json").write_text(json.dumps(opencode_config(base_url, model), indent=2))
    env = {
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",  # models.dev
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "npm_config_offline": "true",  # its config folders' plugin package is not fetched from npm
    }
    return ["run", "--format", "json"], env


def _opencode_parts(stdout: str) -> list[dict[str, Any]]:
    return [e["part"] for e in _json_lines(stdout) if isinstance(e.get("part"), dict)]


def _opencode_answer(stdout: str) -> str:
    texts = [p.get("text", "") for p in _opencode_parts(stdout) if p.get("type") == "text"]
    return texts[-1] if texts else ""


def _opencode_tool_output(stdout: str) -> str:
    out = []
    for part in _opencode_parts(stdout):
        state = part.get("state") if isinstance(part.get("state"), dict) else {}
        if part.get("type") == "tool" and state.get("status") == "completed":
            out.append(str(state.get("output", "")))
    return "\n".join(out)


OPENCODE = AgentClient(
    name="opencode",
    package="opencode-ai",
    binary="opencode",
    route="/v1/chat/completions",
    fixture="opencode_chat.json",
    preface="opencode_title_chat.json",  # the session's title, asked first
    tool_call=lambda workdir: Call("bash", {"command": f"cat {NOTE}"}),
    configure=_opencode_configure,
    answer=_opencode_answer,
    tool_output=_opencode_tool_output,
)


# -- Claude Code -------------------------------------------------------------------------------
def _claude_configure(home: Path, workdir: Path, base_url: str, model: str) -> Configured:
    env = {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": API_KEY,
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_MAX_RETRIES": "1",  # not 10 over three minutes: a local server's error stays
    }
    return ["--output-format", "stream-json", "--verbose", "--allowedTools", f"Bash(cat {NOTE})", "-p"], env


def _claude_answer(stdout: str) -> str:
    results = [e for e in _json_lines(stdout) if e.get("type") == "result"]
    return str(results[-1].get("result", "")) if results else ""


def _claude_tool_output(stdout: str) -> str:
    out = []
    for event in _json_lines(stdout):
        if event.get("type") != "user":
            continue
        for part in (event.get("message") or {}).get("content") or []:
            if isinstance(part, dict) and part.get("type") == "tool_result":
                out.append(_text(part.get("content")))
    return "\n".join(out)


CLAUDE_CODE = AgentClient(
    name="claude-code",
    package="@anthropic-ai/claude-code",
    binary="claude",
    route="/v1/messages",
    fixture="claude_code_messages.json",
    tool_call=lambda workdir: Call("Bash", {"command": f"cat {NOTE}"}),
    configure=_claude_configure,
    answer=_claude_answer,
    tool_output=_claude_tool_output,
    follow_up="claude_code_messages_tool_result.json",
)


# -- Codex -------------------------------------------------------------------------------------
def codex_config(base_url: str, model: str) -> str:
    """Codex's config.toml: a Responses-API provider at ``base_url``, nothing else reached."""
    return textwrap.dedent(f"""\
        model = "{model}"
        model_provider = "hf2q"
        check_for_update_on_startup = false

        [model_providers.hf2q]
        name = "hf2q-py"
        base_url = "{base_url}/v1"
        wire_api = "responses"
        env_key = "HF2Q_API_KEY"
        request_max_retries = 1   # not 4, times 5 reconnects: a local server's error stays
        stream_max_retries = 1

        [analytics]
        enabled = false

        [features]
        plugins = false         # else it clones github.com/openai/plugins
        remote_plugin = false
        apps = false            # else it looks up chatgpt.com
        """)


def codex_catalog(setup: Setup, model: str, context: int = 65536) -> Path:
    """Give a Codex run a model catalog naming ``model`` (``model_catalog_json``):
    Codex then knows the model's context, and offers ``apply_patch`` as a
    freeform tool with its Lark grammar (``apply_patch_tool_type``), as it does
    for OpenAI's own models."""
    path = setup.home / "codex-models.json"
    path.write_text(json.dumps({"models": [{
        "slug": model, "display_name": model, "description": "served by hf2q-py",
        "default_reasoning_level": "medium", "supported_reasoning_levels": [{"effort": "medium", "description": "Medium"}],
        "shell_type": "unified_exec", "visibility": "list", "supported_in_api": True, "priority": 1,
        "base_instructions": "You are a coding agent. Edit files with apply_patch.", "supports_reasoning_summaries": False,
        "default_reasoning_summary": "none", "support_verbosity": False, "default_verbosity": None,
        "apply_patch_tool_type": "freeform", "truncation_policy": {"mode": "tokens", "limit": 10000},
        "supports_parallel_tool_calls": True, "context_window": context, "effective_context_window_percent": 95,
        "experimental_supported_tools": [], "input_modalities": ["text"], "supports_search_tool": False,
    }]}))  # fmt: skip
    config = setup.home / ".codex" / "config.toml"
    config.write_text(f'model_catalog_json = "{path}"\n' + config.read_text())
    return path


def _codex_configure(home: Path, workdir: Path, base_url: str, model: str) -> Configured:
    codex_home = home / ".codex"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(codex_config(base_url, model))
    env = {"CODEX_HOME": str(codex_home), "HF2Q_API_KEY": API_KEY}
    return ["exec", "--json", "--skip-git-repo-check"], env


def _codex_items(stdout: str) -> list[dict[str, Any]]:
    return [e["item"] for e in _json_lines(stdout) if e.get("type") == "item.completed" and "item" in e]


def _codex_answer(stdout: str) -> str:
    texts = [i.get("text", "") for i in _codex_items(stdout) if i.get("type") == "agent_message"]
    return texts[-1] if texts else ""


def codex_file_changes(stdout: str) -> list[dict[str, Any]]:
    """The file changes Codex made (its ``apply_patch`` runs), as it reports them."""
    return [i for i in _codex_items(stdout) if i.get("type") == "file_change"]


def _codex_tool_output(stdout: str) -> str:
    items = [i for i in _codex_items(stdout) if i.get("type") == "command_execution"]
    return "\n".join(str(i.get("aggregated_output", "")) for i in items)


CODEX = AgentClient(
    name="codex",
    package="@openai/codex",
    binary="codex",
    route="/v1/responses",
    fixture="codex_responses.json",
    tool_call=lambda workdir: Call("exec_command", {"cmd": f"cat {NOTE}"}),
    configure=_codex_configure,
    answer=_codex_answer,
    tool_output=_codex_tool_output,
)

CLIENTS = {c.name: c for c in (QWEN_CODE, OPENCODE, CLAUDE_CODE, CODEX)}
