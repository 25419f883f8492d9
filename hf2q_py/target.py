"""The model runtime: a loaded model plus one live, trimmable KV cache.

``Target`` pairs an mlx-lm model with its tokenizer. ``Runtime`` owns the KV
cache of one sequence and offers the three forwards every method needs:
``prefill`` (many tokens), ``decode`` (one token) and ``verify`` (the last
committed token plus K drafts), each optionally capturing hidden states in the
same forward. All results are lazy MLX arrays. A Target's ``kv``
(:class:`~hf2q_py.kv.KVConfig`) says how its runtimes' attention caches store
keys and values: full precision (the default), or quantized to 8 or 4 bits.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path
from functools import cached_property
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Hashable, Sequence


import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from .distributed import Sharding
from .errors import Hf2qError
from .kv import FULL_PRECISION, KVConfig, attention_refusal, head_dim_refusal, shared_views
from .memory import DraftMemory
from .cache import (
    DEFAULT_SLACK,
    QuantizedKVCache,
    cache_state,
    layer_shapes,
    make_cache,
    restore_layer,
    save_layer,
    trim_cache,
)
from .prompt_cache import PromptCache, Snapshot
from .recurrent import RecurrentLog
from .taps import embedding, find_decoder, language_model, tapped

PREFILL_CHUNK = 512  # small enough that Ctrl-C (seen between chunks) answers within seconds


@dataclass
class Forward:
    """One forward's outputs. ``logits``: (L, vocab) for the kept positions;
    ``hidden``: captured layer outputs (1, L, H) by layer index; ``final``:
    the final-norm output (1, L', H) for the kept positions."""

    logits: mx.array | None
    hidden: dict[int, mx.array]
    final: mx.array | None = None


@dataclass
class Kept:
    """What generations on one Target keep for later ones, by kind."""

    #: Adaptive K's forward timings (``draft_length.Timings``), per method.
    timings: dict[str, Any] = field(default_factory=dict)
    #: Draft models loaded from a path or repo id, by source.
    draft_models: dict[str, Target] = field(default_factory=dict)
    #: DFlash drafters loaded from a folder, by folder.
    drafters: dict[str, Any] = field(default_factory=dict)
    #: A DFlash drafter's draft vocabulary and the target's output rows for
    #: it, by the vocabulary's identity.
    draft_heads: dict[Hashable, Any] = field(default_factory=dict)
    #: Layer skip's measured choice per recipe ("auto"): a skip set, or None
    #: when no skip set beat plain decoding.
    skip_sets: dict[str, list[int] | None] = field(default_factory=dict)
    #: The generation (its proposer) measuring a layer-skip recipe's choice
    #: now, by recipe: others with that recipe do not measure meanwhile.
    calibrating: dict[str, Any] = field(default_factory=dict)

    def clear(self) -> None:
        for d in (self.timings, self.draft_models, self.drafters, self.draft_heads, self.skip_sets,
                  self.calibrating):  # fmt: skip
            d.clear()


#: How a line break is spelled in a vocabulary's token strings: literally,
#: byte-level BPE's stand-in for byte 0x0A, SentencePiece's byte fallback.
LINE_BREAK_SPELLINGS = ("\n", "\u010a", "<0x0A>")


def line_break_tokens(tokenizer: Any) -> frozenset[int]:
    """Token ids whose text holds a line break, read from the vocabulary's
    token strings (no decoding); empty without a tokenizer or vocabulary."""
    vocab = getattr(tokenizer, "vocab", None) if tokenizer is not None else None
    if not isinstance(vocab, dict):
        return frozenset()
    return frozenset(i for text, i in vocab.items() if any(m in text for m in LINE_BREAK_SPELLINGS))


class Target:
    """A language model and its tokenizer, ready for generation.

    For multimodal wrappers (``gemma3``, ``gemma4``, ``mistral3``, ``qwen3_5``,
    the Qwen VL families as mlx-lm builds them), ``lm`` is the text model
    inside, whose configuration the properties read; ``model`` stays the
    wrapper that forwards are run on.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        source: str = "<in-memory>",
        sharding: Sharding | None = None,
        kv: KVConfig = FULL_PRECISION,
    ):
        self.model = model
        self.lm = language_model(model)
        self.tokenizer = tokenizer
        self.source = source
        self._decoder = find_decoder(model)
        #: Token ids that end generation (from the tokenizer; may be replaced).
        self.eos_token_ids: set[int] = set(tokenizer.eos_token_ids) if tokenizer is not None else set()
        #: What generations on this target keep for later ones (``kept.clear()``
        #: forgets it and frees the models).
        self.kept = Kept()
        #: Earlier generations, drafted from by the n-gram method's suffix
        #: proposer (``memory=False`` turns it off; ``memory.clear()`` empties it).
        self.memory = DraftMemory()
        #: Model states by token prefix, so a prompt that extends an earlier
        #: one prefills only its new tokens (None: off; the server turns it on).
        self.prompt_cache: PromptCache | None = None
        #: How the model is split over an ``mlx.launch`` group (None: it is whole).
        self.sharding = sharding
        self._kv_checked: dict[KVConfig, str | None] = {}
        self._shapes: tuple | None = None
        self.kv = kv

    @property
    def kv(self) -> KVConfig:
        """How runtimes on this target store attention keys and values
        (settable; checked against the model when set)."""
        return self._kv

    @kv.setter
    def kv(self, kv: KVConfig) -> None:
        self.check_kv(kv)
        self._kv = kv

    def check_kv(self, kv: KVConfig) -> None:
        """Refuse a KV configuration this model cannot use (an ``Hf2qError``
        naming the option): bad values, a group size its head dimensions
        cannot take, attention that cannot read quantized keys."""
        if not isinstance(kv, KVConfig):
            raise Hf2qError(f"kv must be a KVConfig, got {type(kv).__name__}")
        kv.validate()
        if kv not in self._kv_checked:
            self._kv_checked[kv] = self._kv_refusal(kv)
        if self._kv_checked[kv] is not None:
            raise Hf2qError(self._kv_checked[kv])

    def _kv_refusal(self, kv: KVConfig) -> str | None:
        if not kv.quantized:
            return None
        problem = attention_refusal(self.layers, self.model_type)
        return problem or head_dim_refusal(self.layer_shapes(), kv.group_size)

    def layer_shapes(self) -> tuple:
        """Each layer cache's shape (``hf2q_py.cache.layer_shapes``), read once."""
        if self._shapes is None:
            self._shapes = layer_shapes(self)
        return self._shapes

    @cached_property
    def identity(self) -> str:
        """A digest of the model (configuration, parameters' names, shapes,
        dtypes and a sample of their values, the MLX version and device),
        computed once: the prompt cache on disk keys its files by it."""
        from .identity import model_identity

        return model_identity(self.model, self.lm)

    def save_cache(self, path: str | Path, snapshots: Sequence[Snapshot] | None = None) -> int:
        """Write the prompt cache's snapshots (or ``snapshots``) to the folder
        ``path`` in the disk tier's layout (docs/server.md); returns how many.
        Raises ``Hf2qError`` when the folder cannot be written."""
        from .disk_cache import save_snapshots

        if snapshots is None:
            snapshots = self.prompt_cache.snapshots() if self.prompt_cache is not None else []
        return save_snapshots(self, path, snapshots)

    def load_cache(self, path: str | Path) -> int:
        """Read every snapshot saved in the folder ``path`` into this Target's
        prompt cache (made with the default bounds if there is none); returns
        how many. Raises ``Hf2qError`` naming the file for a file that is
        corrupt, truncated, or saved by another model or cache layout."""
        from .disk_cache import load_snapshots

        snaps = load_snapshots(self, path)
        if self.prompt_cache is None:
            self.prompt_cache = PromptCache()
        for snap in snaps:
            self.prompt_cache.add(snap)
        return len(snaps)

    @cached_property
    def line_breaks(self) -> frozenset[int]:
        """Token ids whose text holds a line break (``line_break_tokens``)."""
        return line_break_tokens(self.tokenizer)

    @classmethod
    def from_mlx_lm(cls, model: Any, tokenizer: Any = None) -> Target:
        """Wrap a model from ``mlx_lm.load`` (or built in code). ``tokenizer``
        may be None when prompts are token ids."""
        return cls(model, tokenizer)

    @property
    def layers(self) -> list:
        """The language model's decoder layers (pipeline-sharded: this rank's)."""
        if self._decoder is None:
            return self.lm.layers
        if getattr(self._decoder, "pipeline_size", 1) > 1:
            return self._decoder.pipeline_layers
        return self._decoder.layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def config(self, name: str) -> Any:
        """A field of the language model's configuration, or None."""
        value = _config_value(self.lm, name)
        return _config_value(self.model, name) if value is None else value

    @property
    def model_type(self) -> str:
        return str(self.config("model_type") or "")

    @property
    def hidden_size(self) -> int:
        return self.config("hidden_size")

    @property
    def embed_tokens(self) -> Any:
        return embedding(self._decoder)

    @property
    def embed_scale(self) -> float:
        """What the model multiplies its token embeddings by (Gemma: sqrt(hidden))."""
        scale = getattr(self._decoder, "embed_scale", None)
        if scale is None and self.model_type.startswith("gemma"):
            scale = self.hidden_size**0.5
        return float(scale or 1.0)

    @property
    def lm_head(self) -> Any:
        """The output projection (the embedding's ``as_linear`` when tied)."""
        head = getattr(self.lm, "lm_head", None)
        return head if head is not None else self.embed_tokens.as_linear

    @property
    def softcap(self) -> float | None:
        """The final logit soft-capping value, or None."""
        cap = getattr(self.lm, "final_logit_softcapping", None)
        return cap if cap is not None else self.config("final_logit_softcapping")

    @property
    def sliding_window(self) -> int | None:
        return self.config("sliding_window")

    @property
    def vocab_size(self) -> int:
        return self.config("vocab_size")

    def runtime(
        self, slack: int = DEFAULT_SLACK, rollback: int | None = None, kv: KVConfig | None = None
    ) -> Runtime:
        """A fresh sequence with an empty cache; ``slack`` bounds multi-step rollback
        on sliding-window layers, ``rollback`` (default: ``slack``) on recurrent ones;
        ``kv``: how its attention caches store keys and values (default: ``self.kv``)."""
        return Runtime(self, slack, rollback, kv)


def _joined(a: Forward, b: Forward, logits: str) -> Forward:
    """Two consecutive forwards as one: logits of both ("all") or the second's."""
    out = mx.concatenate([a.logits, b.logits]) if logits == "all" else b.logits
    hidden = {i: mx.concatenate([h, b.hidden[i]], axis=1) for i, h in a.hidden.items()}
    final = b.final
    if logits == "all" and a.final is not None:
        final = mx.concatenate([a.final, b.final], axis=1)
    return Forward(out, hidden, final)


def _config_value(model: Any, name: str) -> Any:
    args = getattr(model, "args", None) or getattr(model, "config", None)
    value = args.get(name) if isinstance(args, dict) else getattr(args, name, None)
    if value is None:
        text = args.get("text_config") if isinstance(args, dict) else getattr(args, "text_config", None)
        value = text.get(name) if isinstance(text, dict) else getattr(text, name, None)
    return value


class Runtime:
    """One sequence's caches and the forwards over it.

    ``trim`` is exact on every cache kind: attention KV caches drop positions,
    recurrent layers (hybrid models) get back their state after the kept
    positions through a :class:`~hf2q_py.recurrent.RecurrentLog`, which can
    roll back the last ``rollback`` positions of short forwards.
    """

    #: What the engine times rounds with (a recorded runtime models time instead).
    clock = staticmethod(time.perf_counter)

    def __init__(
        self,
        target: Target,
        slack: int = DEFAULT_SLACK,
        rollback: int | None = None,
        kv: KVConfig | None = None,
    ):
        self.target = target
        self.model = target.model
        if kv is None:
            kv = target.kv
        else:
            target.check_kv(kv)
        #: How the attention caches store keys and values.
        self.kv = kv
        self.cache = make_cache(self.model, slack, kv)
        # KV-shared layers (Gemma 4) read quantized keys through stand-ins for their caches
        self._forward_cache = self.cache + (shared_views(self.model, self.cache) if kv.quantized else [])
        self.recurrent = RecurrentLog.create(target.layers, self.cache, rollback or slack)
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
        """Append ``tokens`` to the cache; ``logits`` is "all", "last" or "none".
        A forward that would cross ``kv.start`` runs as two, split there, so
        every query sees what it would in single-token decoding."""
        x = tokens if isinstance(tokens, mx.array) else mx.array(tokens, dtype=mx.uint32)
        if x.ndim == 1:
            x = x[None]
        taps = dict(capture_layers=capture_layers, capture_final=capture_final, skip_layers=skip_layers)
        cut = self.kv.start - self.offset
        if self.kv.quantized and 0 < cut < x.shape[1]:
            head = self._forward(x[:, :cut], logits="all" if logits == "all" else "none", **taps)
            return _joined(head, self._forward(x[:, cut:], logits=logits, **taps), logits)
        return self._forward(x, logits=logits, **taps)

    def _forward(
        self,
        x: mx.array,
        *,
        logits: str,
        capture_layers: Sequence[int],
        capture_final: bool,
        skip_layers: Sequence[int],
    ) -> Forward:
        keep = {"all": None, "last": slice(-1, None), "none": slice(-1, None)}[logits]
        with (
            tapped(
                self.model,
                capture_layers=capture_layers,
                capture_final=capture_final,
                keep_positions=keep,
                skip_layers=skip_layers,
            ) as rec,
            self._recording(x.shape[1]),
        ):
            out = self.model(x, cache=self._forward_cache)
        self.offset += x.shape[1]
        if self.target._decoder is None and keep is not None:
            out = out[:, keep]
        return Forward(None if logits == "none" else out[0], rec.layers, rec.final)

    def _recording(self, length: int):
        return self.recurrent.recording(length) if self.recurrent is not None else nullcontext()

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        logits: str = "last",
        capture_layers: Sequence[int] = (),
        capture_final: bool = False,
    ) -> Forward:
        """Batched forward over many tokens, in chunks of ``PREFILL_CHUNK`` (512); the cache is
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

    def read(self, result: mx.array) -> list:
        """Block until ``result``, computed from the oldest forward not yet
        read, is computed, and return its values (a round's one read)."""
        return result.tolist()

    def trim(self, n: int, skip_layers: Sequence[int] = ()) -> None:
        """Drop the last ``n`` positions from the cache (exact on every layer
        type). After forwards that skipped layers, pass the same
        ``skip_layers``: those layers' caches hold no such positions."""
        if n < 0 or n > self.offset:
            raise ValueError(f"cannot trim {n} positions from a cache of {self.offset}")
        skipped = set(skip_layers)
        trim_cache(
            [c for i, c in enumerate(self.cache) if i not in skipped and not isinstance(c, ArraysCache)], n
        )
        if self.recurrent is not None:
            self.recurrent.trim(n)
        self.offset -= n

    def state(self) -> list[Any]:
        return cache_state(self.cache)

    @property
    def trimmable(self) -> bool:
        """Whether every layer is full attention, whose state can be cut back
        to any shorter prefix (sliding windows and recurrent layers cannot)."""
        return all(type(c) in (KVCache, QuantizedKVCache) for c in self.cache)

    def snapshot(self, tokens: Sequence[int]) -> Snapshot:
        """The caches' contents now, which hold exactly ``tokens`` (evaluated, not copied)."""
        if len(tokens) != self.offset:
            raise ValueError(f"the cache holds {self.offset} positions, not {len(tokens)}")
        layers = tuple(save_layer(c, self.offset) for c in self.cache)
        mx.eval([a for layer in layers for a in layer.arrays if a is not None])
        return Snapshot(tuple(tokens), layers, self.kv)

    def restore(self, snap: Snapshot, n: int) -> None:
        """Start this fresh sequence from the first ``n`` tokens of ``snap``."""
        if self.offset != 0:
            raise ValueError("restore needs a fresh runtime")
        if snap.kv != self.kv:
            raise ValueError(
                f"a snapshot made with {snap.kv.describe()} cannot be restored into {self.kv.describe()}"
            )
        if len(snap.layers) != len(self.cache) or not snap.reaches(n):
            raise ValueError(f"this snapshot cannot rebuild the state after {n} tokens")
        for c, layer in zip(self.cache, snap.layers):
            restore_layer(c, layer, n)
        self.offset = n
