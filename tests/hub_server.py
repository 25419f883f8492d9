"""A stand-in Hugging Face hub on a loopback port, for tests without internet.

It answers what ``huggingface_hub`` calls to list and download a model repo:
``GET /api/models/{owner}/{name}[/revision/{rev}]`` (``sha``, ``siblings``),
``GET /api/models/{owner}/{name}/tree/{rev}`` (files with sizes), and
``HEAD``/``GET /{owner}/{name}/resolve/{rev}/{path}`` (``ETag``,
``X-Repo-Commit``, ``Content-Length``; ``Range`` for resumed downloads). Errors
carry the hub's ``X-Error-Code`` (``RepoNotFound``, ``GatedRepo``,
``EntryNotFound``), so ``huggingface_hub`` raises the exceptions it raises
against the real hub.

Run it alone (``python tests/hub_server.py``) to serve ``owner/tiny-mlx-model``
and ``owner/tiny-gguf-repo`` (Q8_0, Q4_0, F16) and try ``hf2q-py`` against it
with ``HF_ENDPOINT``.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

#: The token that opens gated and private repos.
TOKEN = "hf_standin_token"


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False  # files need TOKEN (the listing does not, as on the hub)
    private: bool = False  # everything needs TOKEN

    @property
    def sha(self) -> str:
        h = hashlib.sha1()
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + hashlib.sha256(self.files[name]).digest())
        return h.hexdigest()


@dataclass
class Cut:
    """Drop the connection after ``after`` bytes of a file's body, ``times``
    times; then answer every later GET of the file with status ``then`` (a
    server that stays broken), unless it is None."""

    after: int
    times: int = 1
    then: int | None = None


@dataclass
class Hub:
    repos: dict[str, Repo] = field(default_factory=dict)
    cuts: dict[tuple[str, str], Cut] = field(default_factory=dict)
    #: (method, path, Range header) of every request, in order
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    url: str = ""
    _server: ThreadingHTTPServer | None = None

    def add(self, repo_id: str, files: dict[str, bytes], **kw) -> Repo:
        self.repos[repo_id] = Repo(dict(files), **kw)
        return self.repos[repo_id]

    def fetched(self, repo_id: str) -> list[tuple[str, str | None]]:
        """(file, Range header) of every GET of one of the repo's files, in order."""
        marker = f"/{repo_id}/resolve/"
        return [
            (p.split(marker, 1)[1].split("/", 1)[1], r)
            for m, p, r in self.requests
            if m == "GET" and p.startswith(marker)
        ]

    def start(self) -> Hub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Hub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
_TREE = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class _Handler(BaseHTTPRequestHandler):
    hub: Hub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    # -- routing ------------------------------------------------------------------
    def _answer(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.requests.append((self.command, path, self.headers.get("Range")))
        if m := _TREE.match(path):
            return self._tree(m.group(1), m.group(3) or "")
        if m := _API.match(path):
            return self._info(m.group(1))
        if m := _RESOLVE.match(path):
            return self._file(m.group(1), m.group(3), body)
        self._error(404, "EntryNotFound", "no such endpoint")

    def _repo(self, repo_id: str, files: bool) -> Repo | None:
        """The repo, or None once an error was sent (missing, private, gated)."""
        repo = self.hub.repos.get(repo_id)
        authorized = self.headers.get("Authorization") == f"Bearer {TOKEN}"
        if repo is None or (repo.private and not authorized):
            self._error(401, "RepoNotFound", "Repository not found")
            return None
        if repo.gated and files and not authorized:
            self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted.")
            return None
        return repo

    # -- endpoints ----------------------------------------------------------------
    def _info(self, repo_id: str) -> None:
        repo = self._repo(repo_id, files=False)
        if repo is None:
            return
        info = {
            "_id": repo.sha[:24],
            "id": repo_id,
            "modelId": repo_id,
            "sha": repo.sha,
            "private": repo.private,
            "gated": "auto" if repo.gated else False,
            "disabled": False,
            "tags": [],
            "siblings": [{"rfilename": name} for name in sorted(repo.files)],
        }
        self._json(info)

    def _tree(self, repo_id: str, under: str) -> None:
        repo = self._repo(repo_id, files=False)
        if repo is None:
            return
        prefix = under.rstrip("/") + "/" if under else ""
        entries = [
            {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": name}
            for name, data in sorted(repo.files.items())
            if name.startswith(prefix)
        ]
        self._json(entries)

    def _file(self, repo_id: str, name: str, body: bool) -> None:
        repo = self._repo(repo_id, files=True)
        if repo is None:
            return
        data = repo.files.get(name)
        if data is None:
            return self._error(404, "EntryNotFound", f"{name} does not exist")
        start = _range_start(self.headers.get("Range"))
        cut = self.hub.cuts.get((repo_id, name)) if body else None
        if cut is not None and cut.times == 0 and cut.then is not None:
            return self._error(cut.then, None, "the server broke")
        part = data[start:]
        self.send_response(206 if start else 200)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("X-Repo-Commit", repo.sha)
        self.send_header("Content-Length", str(len(part)))
        self.send_header("Accept-Ranges", "bytes")
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return
        if cut is not None and cut.times > 0 and start < cut.after:
            cut.times -= 1
            self.wfile.write(part[: cut.after - start])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)  # the server dies mid-file
            return
        self.wfile.write(part)

    # -- responses ----------------------------------------------------------------
    def _json(self, obj) -> None:
        raw = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(raw)

    def _error(self, status: int, code: str | None, message: str) -> None:
        raw = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code is not None:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(raw)


def _range_start(header: str | None) -> int:
    m = re.fullmatch(r"bytes=(\d+)-", header or "")
    return int(m.group(1)) if m else 0


# -- the repos the tests serve --------------------------------------------------------
def tiny_mlx_files(seed: int = 0, vocab_size: int = 512) -> dict[str, bytes]:
    """An mlx-lm model folder's files: a tiny random llama with a BPE tokenizer
    and a chat template (and a README the download leaves out); a large
    ``vocab_size`` makes its weights file large (4 * 64 bytes a token)."""
    import tempfile
    from pathlib import Path

    from models import CONFIGS, tiny_model  # imports hf2q_py before mlx

    import mlx.core as mx
    from mlx.utils import tree_flatten

    cfg = dict(CONFIGS["llama"], vocab_size=vocab_size, max_position_embeddings=4096)
    model = tiny_model(cfg, seed)
    with tempfile.TemporaryDirectory() as d:
        mx.save_safetensors(str(Path(d) / "model.safetensors"), dict(tree_flatten(model.parameters())))
        weights = (Path(d) / "model.safetensors").read_bytes()
    tokenizer, tokenizer_config = _tokenizer_files(cfg["vocab_size"])
    return {
        "config.json": json.dumps(cfg).encode(),
        "model.safetensors": weights,
        "tokenizer.json": tokenizer,
        "tokenizer_config.json": tokenizer_config,
        "README.md": b"# a tiny model\n",
        "original/consolidated.pth": b"\0" * 64,  # not a file an MLX model needs
    }


def _tokenizer_files(vocab_size: int) -> tuple[bytes, bytes]:
    """A byte-level BPE tokenizer.json with ``vocab_size`` entries and its config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|im_start|>": 0, "<|im_end|>": 1}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    assert tok.get_vocab_size() <= vocab_size
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "bos_token": None,
        "chat_template": template,
    }
    return tok.to_str().encode(), json.dumps(config).encode()


def tiny_drafter_files(model_files: dict[str, bytes]) -> dict[str, bytes]:
    """A DFlash drafter folder's files for the model of ``model_files`` (random weights)."""
    import tempfile
    from pathlib import Path

    import hf2q_py
    from hf2q_py.tools.dflash_make import drafter_for, save_drafter

    with tempfile.TemporaryDirectory() as d:
        for name, data in model_files.items():
            (Path(d) / "model" / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(d) / "model" / name).write_bytes(data)
        target = hf2q_py.load(Path(d) / "model", progress=False)
        save_drafter(
            drafter_for(target, layers=1, block_size=4, target_layer_ids=[0, 2]), Path(d) / "drafter"
        )
        files = {p.name: p.read_bytes() for p in (Path(d) / "drafter").iterdir()}
    return {**files, "README.md": b"# a drafter\n"}


def tiny_gguf_files(quants=("Q8_0", "Q4_0", "F16"), split: str | None = None, stem: str = "tiny") -> dict:
    """GGUF files of one tiny random llama, one per quantization
    (``{stem}-{QUANT}.gguf``); ``split`` names a quantization written as a
    split GGUF (``-0000i-of-0000n.gguf`` parts)."""
    import tempfile
    from pathlib import Path

    import gguf
    from gguf_export import export

    files = {}
    with tempfile.TemporaryDirectory() as d:
        for quant in quants:
            path = Path(d) / f"{stem}-{quant}.gguf"
            export(path, "llama", gguf.GGMLQuantizationType[quant], split_tensors=8 if quant == split else 0)
        for path in sorted(Path(d).iterdir()):
            files[path.name] = path.read_bytes()
    return files


def main() -> None:
    import argparse
    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    hub = Hub()
    hub.add("owner/tiny-mlx-model", tiny_mlx_files())
    hub.add("owner/tiny-gguf-repo", tiny_gguf_files())
    hub.start()
    if args.port:  # a fixed port: serve there instead
        hub.stop()
        server = ThreadingHTTPServer(("127.0.0.1", args.port), type("H", (_Handler,), {"hub": hub}))
        hub.url = f"http://127.0.0.1:{args.port}"
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"HF_ENDPOINT={hub.url}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
