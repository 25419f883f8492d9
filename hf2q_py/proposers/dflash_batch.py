"""DFlash drafting for a batch: one drafter forward drafts a block for every
DFlash row that shares the drafter.

Each row's drafter context (the fused target features of its committed
tokens, as keys and values per drafter layer) lives in slots, the way the
target's own batch caches do (:mod:`hf2q_py.batch.cache`): buffers
``(rows, kv_heads, slots, d)`` written column by column, every row at the
same columns, each slot tagged with the position it holds in its row. A
round appends each row's pending features (as many as it verified, a
different number per row: the rest of its columns stay empty), then runs
the blocks ``[last, mask, ...]`` of every row at once, each at its own
positions (RoPE per row), attending to its own live slots (a mask) and to
its block. Only verified positions ever enter a context, so nothing is
trimmed; when the slots fill they are packed to the left.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import mlx.core as mx
import numpy as np

from .. import kv as stores
from ..batch.cache import EMPTY, SlotKVCache, SlotTable
from ..draft_length.batch import BatchCosts, DraftPlan, Pricing
from .base import Draft, DraftAsk, ask_offer
from .dflash_drafter import Drafter, DrafterCache, TargetHead


class DFlashRow(Protocol):
    """What a batch asks of a row's proposer (``dflash.DFlashProposer``): its
    drafter context, lent while it is a row and given back as ``cache``, its
    captured features, and its drafts from the batch's logits."""

    cache: DrafterCache

    def lend_context(self) -> DrafterCache: ...

    def take_pending(self) -> mx.array | None: ...

    def drafts(self, logits: mx.array, tokens: Sequence[int]) -> Draft: ...


class DrafterRows:
    """The drafter contexts of many rows, in slots (see the module docstring)."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.table = SlotTable(None, keep=0)  # full attention: every position stays
        self.caches = [SlotKVCache(self.table) for _ in drafter.layers]
        self.rows: list[Hashable] = []

    def add(self, row: Hashable, cache: DrafterCache) -> None:
        """A row whose context is ``cache`` (a single generation's)."""
        n = cache.offset
        if n > self.table.capacity:
            self.table.grow(n)
            for c in self.caches:
                c.fit(None)
        self.table.add_row(np.arange(n, dtype=np.int32), n)
        for i, c in enumerate(self.caches):
            c.add_row(cache.keys[i] if n else None, cache.values[i] if n else None)
        self.rows.append(row)

    def take(self, row: Hashable) -> DrafterCache:
        """Row ``row`` leaves: its context as a single generation's cache."""
        b = self.rows.index(row)
        out = DrafterCache(len(self.caches))
        out.offset = int(self.table.offsets[b])
        if out.offset:
            for i, c in enumerate(self.caches):
                out.keys[i], out.values[i] = c.row(b)
        keep = [i for i in range(len(self.rows)) if i != b]
        self.table.remove_rows(keep)
        for c in self.caches:
            c.remove_rows(keep)
        self.rows.pop(b)
        return out

    def append(self, features: Sequence[mx.array | None]) -> None:
        """Add row b's new context ``features[b]`` ((1, n_b, ...), or None)."""
        widths = [0 if f is None else f.shape[1] for f in features]
        width = max(widths, default=0)
        if width == 0:
            return
        like = next(f for f in features if f is not None)
        rows = [
            mx.zeros((1, width, like.shape[-1]), like.dtype)
            if f is None
            else (f if f.shape[1] == width else mx.pad(f, [(0, 0), (0, width - f.shape[1]), (0, 0)]))
            for f in features
        ]
        kv = self.drafter.context(mx.concatenate(rows), self.lengths())
        index = self.table.plan(width)
        for c in self.caches:
            c.fit(index)
        self.table.begin(widths)
        for c, (k, v) in zip(self.caches, kv):
            c.update_and_fetch(k, v)
        self.table.end()

    def lengths(self) -> mx.array:
        """Each row's context length: where its block starts, (R,)."""
        return mx.array(self.table.offsets.astype(np.int32))

    def visible(self) -> tuple[mx.array, mx.array]:
        """Which slots hold context (R, 1, 1, S) and their positions (R, S)."""
        pos = self.table.pos[:, : self.table.used]
        return mx.array(pos < EMPTY)[:, None, None, :], mx.array(pos)

    def context(self, layer: int) -> tuple[mx.array, mx.array]:
        """Layer ``layer``'s context keys and values, (R, kv_heads, S, d)."""
        c = self.caches[layer]
        if c.keys is None:
            attn = self.drafter.layers[layer].self_attn
            empty = mx.zeros(
                (len(self.rows), attn.n_kv_heads, 0, attn.head_dim), self.drafter.fc.weight.dtype
            )
            return empty, empty
        used = self.table.used
        return stores.positions(c.keys, 0, used), stores.positions(c.values, 0, used)


class DFlashRows:
    """The ``BatchDrafter`` of a batch's DFlash rows that share one drafter:
    each round, every row's pending features join its context, then one
    forward drafts every row's block (drafts stay lazy), the LM head run on
    as many positions as the ``DraftPlan`` finds worth verifying (none: no
    forward; the features wait). A row's context moves in with it
    (``join``) and out again (``leave``)."""

    def __init__(
        self, drafter: Drafter, head: TargetHead, costs: BatchCosts | None = None, ragged: bool = False
    ):
        self.drafter, self.head = drafter, head
        self.cfg = drafter.config
        self.contexts = DrafterRows(drafter)
        self.members: dict[Hashable, DFlashRow] = {}
        # one forward drafts any number: only the verify prices them (at the batch's costs)
        self.plan = DraftPlan(costs=costs or BatchCosts(), ragged=ragged)

    def join(self, row: Hashable, proposer: DFlashRow) -> None:
        self.contexts.add(row, proposer.lend_context())
        self.members[row] = proposer

    def leave(self, row: Hashable, proposer: DFlashRow) -> None:
        proposer.cache = self.contexts.take(row)
        self.members.pop(row, None)

    def unread_seconds(self, costs: BatchCosts) -> float:
        """Not estimated: its lazy drafts' forwards count in the verify's
        measured cost (so the batch's costs lean towards fewer drafts)."""
        return 0.0

    def propose(self, asks: Sequence[DraftAsk], pricing: Pricing | None = None) -> list[Draft]:
        block = self.cfg.block_size
        others = pricing.others if pricing is not None else ()
        n = min(self.plan.drafts([ask_offer(a) for a in asks], others), block - 1)
        if n == 0:  # no draft pays this round: the features wait for the next
            return [Draft() for _ in asks]
        rows = self.contexts.rows
        self.contexts.append([self.members[r].take_pending() for r in rows])
        firsts = {a.row: a.tokens[-1] for a in asks}
        mask = self.cfg.mask_token_id
        ids = mx.array([[firsts.get(r, mask)] + [mask] * (block - 1) for r in rows], dtype=mx.uint32)
        h = self.drafter.draft_rows(self.head.embed(ids), self.contexts)
        logits = self.head.draft_logits(h[:, 1 : n + 1])  # the LM head only where drafts are taken
        index = {r: b for b, r in enumerate(rows)}
        return [self.members[a.row].drafts(logits[index[a.row], : min(a.k, n)], a.tokens) for a in asks]


def batch_key(drafter: Drafter) -> tuple[str, int]:
    """The key DFlash rows drafting with ``drafter`` share."""
    return ("dflash", id(drafter))
