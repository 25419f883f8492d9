"""DFlash block drafting: one drafter forward proposes a whole block, from
hidden states the target captured in its own prefill, decode and verify
forwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Callable, Hashable, Sequence

import mlx.core as mx

from .dflash_batch import DFlashRows, batch_key
from .dflash_drafter import Drafter, DrafterCache, TargetHead, check_against_target, load_drafter
from ..errors import Hf2qError
from ..target import Target
from .base import Draft, Proposer


def resolve_drafter(drafter: Any, target: Target) -> Drafter:
    """A ``Drafter`` from an object or a folder path, checked against ``target``."""
    if drafter is None:
        raise Hf2qError("method 'dflash' needs a drafter (drafter=... / --drafter PATH)")
    if not isinstance(drafter, Drafter):
        if not isinstance(drafter, (str, Path)):
            raise Hf2qError(f"drafter must be a Drafter or a folder path, got {type(drafter).__name__}")
        drafter = load_drafter(drafter, dtype=_compute_dtype(target))
    check_against_target(drafter.config, target)
    return drafter


def _compute_dtype(target: Target) -> mx.Dtype:
    w = target.embed_tokens.weight
    if w.dtype in (mx.float32, mx.float16, mx.bfloat16):
        return w.dtype
    return target.embed_tokens.scales.dtype  # quantized embedding


class DFlashProposer(Proposer):
    """Drafts up to ``block_size - 1`` tokens per round with a block drafter.

    Context bookkeeping: the target's captured states for committed tokens
    wait in ``pending`` until the next draft, which moves them into the
    drafter's cache. Only verified positions (accepted drafts + the token fed
    before them) are ever added, so the drafter's cache needs no trimming. As
    a batch row its context is lent to the batch's ``DFlashRows`` (``cache``
    is None meanwhile), which drafts for all the rows of its drafter at once.
    """

    name = "dflash"
    lazy_drafts = True

    def __init__(self, target: Target, drafter: Drafter):
        self.drafter = drafter
        self.cfg = drafter.config
        self.head = TargetHead(target, self.cfg.input_embedding_scale, drafter.vocab)
        self.vocab = drafter.vocab
        self.capture_layers = self.cfg.target_layer_ids
        self.cache = drafter.make_cache()
        self.pending: list[mx.array] = []

    def own_memory(self, tokens: int) -> tuple[tuple[Any, ...], int]:
        """The drafter, its cache for ``tokens`` positions, and the target's
        captured states of as many positions (a prompt's wait for the first draft)."""
        cfg = self.cfg
        size = self.drafter.fc.weight.dtype.size
        cache = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * size
        captured = len(self.capture_layers) * cfg.hidden_size * size
        return (self.drafter,), tokens * (cache + captured)

    def _add(self, hidden: dict[int, mx.array], rows: int | None = None) -> None:
        if not hidden:
            return
        feats = mx.concatenate([hidden[i] for i in self.capture_layers], axis=-1)
        self.pending.append(feats if rows is None else feats[:, :rows])

    def start(self, runtime, prompt: Sequence[int], hidden: dict[int, mx.array], decider) -> None:
        self.decider = decider
        self.cache = self.drafter.make_cache()
        self.pending = []
        self._add(hidden)

    def take_pending(self) -> mx.array | None:
        """The captured features not yet in the drafter's context (1, n, ...), now taken; None when none."""
        if not self.pending:
            return None
        feats = mx.concatenate(self.pending, axis=1) if len(self.pending) > 1 else self.pending[0]
        self.pending = []
        return feats

    def batch_drafter(self, batch: Any) -> tuple[Hashable, Callable[[], DFlashRows]]:
        """Rows drafting with the same drafter draft together, one forward for all of them."""
        return batch_key(self.drafter), lambda: DFlashRows(self.drafter, self.head, batch.costs, batch.ragged)

    def lend_context(self) -> DrafterCache:
        """Its drafter context, pending features included, given to a batch
        (which gives it back when the generation leaves)."""
        feats = self.take_pending()
        if feats is not None:
            self.drafter.extend(feats, self.cache)
        cache, self.cache = self.cache, None
        return cache

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        n = min(k, self.cfg.block_size - 1)
        feats = self.take_pending()
        block = mx.array(
            [[tokens[-1]] + [self.cfg.mask_token_id] * (self.cfg.block_size - 1)], dtype=mx.uint32
        )
        h = self.drafter(self.head.embed(block), feats, cache=self.cache)
        return self.drafts(self.head.draft_logits(h[0, 1 : n + 1]), tokens)

    def drafts(self, logits: mx.array, tokens: Sequence[int]) -> Draft:
        """Drafts from the drafter's logits (n, draft vocabulary) for the
        positions after ``tokens``, chosen by this generation's decider."""
        n = logits.shape[0]
        if self.vocab is not None:
            if self.decider.cfg.greedy and not self.decider.needs_context:  # argmax within the subset
                return Draft(self.vocab.ids[mx.argmax(logits, axis=-1)])
            logits = self.vocab.to_full(logits)  # -inf outside the subset: q is zero there
        steps, dists = [], []
        for i in range(n):
            y, q = self.decider.draft_token(logits[i], tokens, i)
            steps.append(y)
            dists.append(q)
        return Draft(mx.stack(steps), mx.stack(dists) if dists[0] is not None else None)

    def update(self, tokens, drafted: int, accepted: int, hidden: dict[int, mx.array]) -> None:
        self._add(hidden, accepted + 1)


def build(target: Target, spec) -> DFlashProposer:
    """The dflash method's proposer (method table); a drafter given as a
    folder is loaded once per target (``target.kept.drafters``)."""
    drafter = spec.drafter
    if isinstance(drafter, (str, Path)):
        kept = target.kept.drafters
        if str(drafter) not in kept:
            kept[str(drafter)] = resolve_drafter(drafter, target)
        drafter = kept[str(drafter)]
    return DFlashProposer(target, resolve_drafter(drafter, target))
