"""The model runtime: a loaded model plus one live, trimmable KV cache.

``Target`` pairs an mlx-lm model with its tokenizer. ``Runtime`` owns the KV
cache of one sequence and offers the three forwards every method needs:
``prefill`` (many tokens), ``decode`` (one token) and ``verify`` (the last
committed token plus K drafts), each optionally capturing hidden states in the
same forward. All results are lazy MLX arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


import mlx.core as mx

from .memory import DraftMemory
from .cache import DEFAULT_SLACK, cache_state, make_cache, trim_cache
from .taps import find_decoder, tapped

PREFILL_CHUNK = 2048


@dataclass
class Forward:
    """One forward's outputs. ``logits``: (L, vocab) for the kept positions;
    ``hidden``: captured layer outputs (1, L, H) by layer index; ``final``:
    the final-norm output (1, L', H) for the kept positions."""

    logits: mx.array | None
    hidden: dict[int, mx.array]
    final: mx.array | None = None


class Target:
    """A language model and its tokenizer, ready for generation."""

    def __init__(self, model: Any, tokenizer: Any = None, *, source: str = "<in-memory>"):
        self.model = model
        self.tokenizer = tokenizer
        self.source = source
        self._decoder = find_decoder(model)
        #: Token ids that end generation (from the tokenizer; may be replaced).
        self.eos_token_ids: set[int] = set(tokenizer.eos_token_ids) if tokenizer is not None else set()
        #: Earlier generations, drafted from by the n-gram method's suffix
        #: proposer (``memory=False`` turns it off; ``memory.clear()`` empties it).
        self.memory = DraftMemory()

    @classmethod
    def from_mlx_lm(cls, model: Any, tokenizer: Any = None) -> "Target":
        """Wrap a model from ``mlx_lm.load`` (or built in code). ``tokenizer``
        may be None when prompts are token ids."""
        return cls(model, tokenizer)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def hidden_size(self) -> int:
        return _config_value(self.model, "hidden_size")

    @property
    def embed_tokens(self) -> Any:
        return self._decoder.embed_tokens

    @property
    def vocab_size(self) -> int:
        return _config_value(self.model, "vocab_size")

    def runtime(self, slack: int = DEFAULT_SLACK) -> "Runtime":
        """A fresh sequence with an empty cache; ``slack`` bounds multi-step rollback
        on sliding-window layers."""
        return Runtime(self, slack)


def _config_value(model: Any, name: str) -> Any:
    args = getattr(model, "args", None) or getattr(model, "config", None)
    value = getattr(args, name, None)
    if value is None and isinstance(args, dict):
        value = args.get(name)
    if value is None:
        text = getattr(args, "text_config", None)
        value = getattr(text, name, None) if text is not None else None
    return value


class Runtime:
    """One sequence's KV cache and the forwards over it."""

    def __init__(self, target: Target, slack: int = DEFAULT_SLACK):
        self.target = target
        self.model = target.model
        self.cache = make_cache(self.model, slack)
        self.offset = 0

    def forward(
        self,
        tokens: Sequence[int] | mx.array,
        *,
        logits: str = "all",
        capture_layers: Sequence[int] = (),
        capture_final: bool = False,
        skip_layers: Sequence[int] = (),
    ) -> Forward:
        """Append ``tokens`` to the cache; ``logits`` is "all", "last" or "none"."""
        x = tokens if isinstance(tokens, mx.array) else mx.array(tokens, dtype=mx.uint32)
        if x.ndim == 1:
            x = x[None]
        keep = {"all": None, "last": slice(-1, None), "none": slice(-1, None)}[logits]
        with tapped(
            self.model,
            capture_layers=capture_layers,
            capture_final=capture_final,
            keep_positions=keep,
            skip_layers=skip_layers,
        ) as rec:
            out = self.model(x, cache=self.cache)
        self.offset += x.shape[1]
        if self.target._decoder is None and keep is not None:
            out = out[:, keep]
        return Forward(None if logits == "none" else out[0], rec.layers, rec.final)

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        logits: str = "last",
        capture_layers: Sequence[int] = (),
        capture_final: bool = False,
    ) -> Forward:
        """Batched forward over many tokens, in chunks of 2048; the cache is
        evaluated between chunks so memory stays bounded. Captured hidden
        states cover every position."""
        tokens = list(tokens)
        hidden: dict[int, list[mx.array]] = {i: [] for i in capture_layers}
        finals: list[mx.array] = []
        fwd = Forward(None, {})
        for start in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[start : start + PREFILL_CHUNK]
            last_chunk = start + PREFILL_CHUNK >= len(tokens)
            fwd = self.forward(
                chunk,
                logits=logits if last_chunk else "none",
                capture_layers=capture_layers,
                capture_final=capture_final,
            )
            for i in capture_layers:
                hidden[i].append(fwd.hidden[i])
            if fwd.final is not None:
                finals.append(fwd.final)
            if not last_chunk:
                mx.eval(cache_state(self.cache), [h[-1] for h in hidden.values()], finals)
        joined = {i: mx.concatenate(h, axis=1) if len(h) > 1 else h[0] for i, h in hidden.items()}
        final = None
        if finals:
            final = mx.concatenate(finals, axis=1) if len(finals) > 1 else finals[0]
        return Forward(fwd.logits, joined, final)

    def decode(self, token: int | mx.array, **kw) -> Forward:
        """Single-token forward; ``logits`` has shape (1, vocab)."""
        t = token.reshape(1, 1) if isinstance(token, mx.array) else [[int(token)]]
        return self.forward(t if isinstance(t, mx.array) else mx.array(t, dtype=mx.uint32), **kw)

    def verify(self, tokens: Sequence[int], **kw) -> Forward:
        """Batched forward of ``[last, d1..dK]``: (K+1, vocab) logits, one per position."""
        return self.forward(tokens, logits="all", **kw)

    def trim(self, n: int, skip_layers: Sequence[int] = ()) -> None:
        """Drop the last ``n`` positions from the cache (exact on every layer
        type). After forwards that skipped layers, pass the same
        ``skip_layers``: those layers' caches hold no such positions."""
        if n < 0 or n > self.offset:
            raise ValueError(f"cannot trim {n} positions from a cache of {self.offset}")
        skipped = set(skip_layers)
        trim_cache([c for i, c in enumerate(self.cache) if i not in skipped], n)
        self.offset -= n

    def state(self) -> list[Any]:
        return cache_state(self.cache)
