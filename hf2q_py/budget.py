"""A memory budget: the bytes one Target's generations may hold in all
(weights, the KV caches of every live generation, the prompt cache, and the
activations of the forwards in flight), and the accounting that keeps a
scheduler inside it.

The accounting is a model, computed from shapes, never from what happens to
be allocated: a generation *reserves* what it may grow to (its prompt plus
its ``max_tokens`` plus the slack of draft columns and allocation steps, at
its KV layout's bytes per position), so admitting it can never over-commit.
The batch pads every row to its longest (one slot column per position,
:mod:`hf2q_py.batch.cache`), so live generations reserve ``n`` rows of the
longest reservation (or of the batch's present capacity, if larger), plus one
row more while two or more run (a row's state is copied when it moves between
the batch and a runtime of its own). Activations are charged for the three
forwards a scheduler step may have in flight: one prefill chunk, one batched
round and one round of a generation running alone (:class:`ForwardShape`).

What MLX does when memory runs out depends on the backend: on Metal a failed
allocation raises a ``RuntimeError`` (``[metal::malloc] ...``, ``[malloc]
Unable to allocate ...``), which :func:`allocation_failure` recognises; on
this Linux CPU build a failed ``malloc`` is not checked (the process dies),
and an over-commit the kernel grants ends with its OOM killer. Keeping
admissions inside the budget is what keeps the process alive.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .batch.cache import STEP
from .errors import Hf2qError
from .kv import FULL_PRECISION, KVConfig, LayerShape
from .validate import check_float, check_int

#: Units a size may carry (decimal and binary).
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}  # fmt: skip
#: The share of the device's memory kept out of a default budget (Python,
#: the tokenizer, host copies, MLX's buffer cache, the rest of the machine).
DEFAULT_MARGIN = 0.1
#: Positions a batch keeps behind a sliding window (``BatchRuntime(keep=64)``,
#: the single runtimes' slack).
WINDOW_KEEP = 64
#: Head dimensions MLX 0.32's fused Metal attention takes for any query length
#: (``has_fused_kernel`` in mlx/backend/metal/scaled_dot_product_attention.cpp).
FUSED_HEAD_DIMS = (64, 96, 128)
#: The widest forward a draft-length policy asks (``MAX_K`` drafts and the last token).
MAX_WIDTH = 257
#: Words in the messages of MLX's failed allocations.
ALLOCATION_FAILED = ("[metal::malloc]", "[malloc] unable to allocate", "insufficient memory", "out of memory")


# -- sizes --------------------------------------------------------------------------
def parse_size(text: str | int, name: str = "size") -> int:
    """A size in bytes from ``12GB``, ``12GiB``, ``640MB``, ``1.5TB`` or a
    number of bytes; an ``Hf2qError`` naming ``name`` otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        return check_int(name, text, 1)
    if not isinstance(text, str):
        raise Hf2qError(
            f"{name}: expected a size such as 12GB, 12GiB, 640MB or a number of bytes, got {text!r}"
        )
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in SIZE_UNITS:
        raise Hf2qError(
            f"{name}: expected a size such as 12GB, 12GiB, 640MB or a number of bytes, got {text!r}"
        )
    value = int(float(m.group(1)) * SIZE_UNITS[unit])
    if value < 1:
        raise Hf2qError(f"{name}: must be at least 1 byte, got {text!r}")
    return value


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``512 B``, ``1.5 MiB``, ``12.0 GiB``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class DeviceMemory:
    """What the device offers: ``total`` bytes, and where the number comes from."""

    total: int
    source: str


def device_memory() -> DeviceMemory:
    """The device's recommended working set (Metal's
    ``max_recommended_working_set_size``), else 80% of physical memory (the
    limit MLX sets itself on a CPU)."""
    info = mx.device_info()
    recommended = info.get("max_recommended_working_set_size")
    if recommended:
        return DeviceMemory(int(recommended), "the device's recommended working set")
    physical = info.get("memory_size") or info.get("total_memory") or physical_memory()
    return DeviceMemory(int(0.8 * physical), "80% of physical memory")


def physical_memory() -> int:
    """The machine's physical memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# -- the configuration ------------------------------------------------------------
@dataclass
class MemoryBudget:
    """What a scheduler's generations may hold in all.

    ``limit``: bytes (or a size such as ``"12GB"``); None: the device's
    memory (:func:`device_memory`) less ``margin`` (a share, 0 to 0.9).
    ``max_waiting``: requests that may wait for memory at once (None: any
    number); one more is refused (HTTP 429). ``name``: how the limit was
    given, for messages (the CLI's ``--memory-budget``)."""

    limit: int | str | None = None
    margin: float = DEFAULT_MARGIN
    max_waiting: int | None = None
    name: str = "memory_budget"

    def validate(self) -> MemoryBudget:
        if self.limit is not None:
            self.limit = parse_size(self.limit, self.name)
        check_float("memory budget margin", self.margin, 0.0, 0.9)
        if self.max_waiting is not None:
            check_int("memory budget max_waiting", self.max_waiting, 0)
        return self

    def resolve(self) -> tuple[int, str]:
        """The budget in bytes, and how it was set (one phrase: ``--memory-budget
        640.0 MiB``, ``16.2 GiB: the device's recommended working set (18.0 GiB) less 10%``)."""
        self.validate()
        if self.limit is not None:
            return int(self.limit), f"{self.name} {format_bytes(self.limit)}"
        dev = device_memory()
        total = int(dev.total * (1 - self.margin))
        return (
            total,
            f"{format_bytes(total)}: {dev.source} ({format_bytes(dev.total)}) less {self.margin:.0%}",
        )


# -- errors -------------------------------------------------------------------------
class MemoryRefused(Hf2qError):
    """A request the budget cannot take: ``status`` 413 (it never fits, even
    alone) or 429 (too many requests wait for memory); the message gives the
    numbers."""

    code = "insufficient_memory"

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class MemoryExhausted(Hf2qError):
    """MLX failed to allocate memory during a generation's forward (HTTP 507)."""

    code = "insufficient_memory"
    status = 507


def allocation_failure(error: BaseException) -> MemoryExhausted | None:
    """``error`` as a :class:`MemoryExhausted` when it is MLX's failed
    allocation (or Python's ``MemoryError``), else None."""
    text = str(error).lower()
    if isinstance(error, MemoryError) or (
        isinstance(error, RuntimeError) and any(w in text for w in ALLOCATION_FAILED)
    ):
        return MemoryExhausted(f"the server ran out of memory during this generation: {error}")
    return None


# -- what a forward and a row cost ----------------------------------------------------
@dataclass(frozen=True)
class ForwardShape:
    """A model's per-position activation widths, for the transient memory of
    its forwards. ``fused``: the backend's attention never materialises the
    scores (MLX's fused Metal kernels, for these head dimensions, at full
    precision)."""

    heads: int  # query heads
    kv_heads: int
    hidden: int
    ffn: int  # the MLP's width per position (MoE: the active experts')
    qkv: int  # q, k and v projections' width per position
    vocab: int
    itemsize: int
    fused: bool = False

    @classmethod
    def of(cls, target: Any, layers: Sequence[LayerShape]) -> ForwardShape:
        attn = [s for s in layers if s.kind != "recurrent"] or [LayerShape("kv", 1, 1, 1)]
        kv_heads, dim = max(s.heads for s in attn), max(max(s.k_dim, s.v_dim) for s in attn)
        heads = target.config("num_attention_heads") or kv_heads
        hidden = target.hidden_size or heads * dim
        ffn = max(target.config("intermediate_size") or 4 * hidden,
                  (target.config("num_experts_per_tok") or 0) * (target.config("moe_intermediate_size") or 0))  # fmt: skip
        dims = {d for s in attn for d in (s.k_dim, s.v_dim)}
        on_gpu = mx.default_device().type == mx.DeviceType.gpu and mx.metal.is_available()
        fused = on_gpu and all(d in FUSED_HEAD_DIMS for d in dims)
        itemsize = max(s.dtype.size for s in attn)
        return cls(heads, kv_heads, hidden, ffn, heads * dim + 2 * kv_heads * dim,
                   target.vocab_size or 1, itemsize, fused)  # fmt: skip

    def bytes(self, rows: int, width: int, columns: int, logits: int, quantized: bool = False) -> int:
        """Peak temporaries of one forward: ``rows`` x ``width`` queries
        against ``columns`` keys, ``logits`` rows of logits. Per query: one
        layer's activations (twice: residual, norms, projections, the MLP's
        three widths) and, unless fused, the attention scores twice in
        float32 and the mask; each logits row in the model's dtype and twice
        in float32 (softmax, log-probabilities)."""
        if rows <= 0 or width <= 0:
            return 0
        act = 2 * self.itemsize * (8 * self.hidden + 3 * self.ffn + self.qkv)
        scores = 6 * self.heads * columns + columns if self.materialised(width, quantized) else 0
        return rows * width * (act + scores) + logits * self.vocab * (self.itemsize + 8)

    def materialised(self, width: int, quantized: bool) -> bool:
        """Whether attention of ``width`` queries writes out its scores: always
        on a CPU and for quantized keys; on Metal unless MLX 0.32's fused
        kernels take the shape (head dims 64/96/128, a query block over 8,
        or one of up to 8 whose GQA group fits 32 rows)."""
        if quantized or not self.fused:
            return True
        return not (width > 8 or width * max(1, self.heads // max(1, self.kv_heads)) <= 32)


@dataclass(frozen=True)
class RowPrice:
    """One row's caches under one KV layout, as prices: ``parts`` (bytes per
    position, the most positions held: None for every one), ``fixed`` bytes
    whatever the length, and each layer's own parts (``layers``)."""

    parts: tuple[tuple[int, int | None], ...]
    fixed: int
    layers: tuple[tuple[tuple[int, int | None], ...], ...]

    @classmethod
    def of(cls, layers: Sequence[LayerShape], kv: KVConfig, window_slack: int) -> RowPrice:
        """Full attention holds every position, sliding windows at most their
        window plus the kept history and ``window_slack`` (the widest write,
        allocation steps), recurrent layers their state twice (the state and
        its rollback log); with ``quantized_kv_start`` > 0 the positions below
        it are also held at full precision."""
        fixed, own = 0, []
        for s in layers:
            if s.kind == "recurrent":
                fixed += 2 * s.fixed_bytes
                own.append(((2 * s.fixed_bytes, 0),))
                continue
            cap = s.window + WINDOW_KEEP + window_slack if s.kind == "window" else None
            pos = kv.position_bytes(s.k_dim, s.heads, s.dtype) + kv.position_bytes(s.v_dim, s.heads, s.dtype)
            parts = [(pos, cap)]
            if kv.quantized and kv.start > 0:
                full = FULL_PRECISION.position_bytes(s.k_dim, s.heads, s.dtype)
                full += FULL_PRECISION.position_bytes(s.v_dim, s.heads, s.dtype)
                parts.append((full, min(cap or kv.start + STEP, kv.start + STEP)))
            own.append(tuple(p for p in parts))
        by_cap: dict[int | None, int] = {}
        for parts in own:
            for pos, cap in parts:
                if cap != 0:
                    by_cap[cap] = by_cap.get(cap, 0) + pos
        return cls(tuple((pos, cap) for cap, pos in by_cap.items()), fixed, tuple(set(own)))

    def bytes(self, columns: int) -> int:
        """The row's caches after ``columns`` positions."""
        return self.fixed + sum(
            pos * (columns if cap is None else min(columns, cap)) for pos, cap in self.parts
        )

    def largest(self, columns: int) -> int:
        """The largest single layer's cache after ``columns`` positions."""
        return max((_held(parts, columns) for parts in self.layers), default=0)


def _held(parts: tuple[tuple[int, int | None], ...], columns: int) -> int:
    return sum(
        pos if cap == 0 else pos * (columns if cap is None else min(columns, cap)) for pos, cap in parts
    )


def model_bytes(model: Any) -> int:
    """The bytes of a model's parameters (each array once)."""
    seen: dict[int, int] = {}
    for _, a in tree_flatten(model.parameters() if hasattr(model, "parameters") else model):
        if isinstance(a, mx.array):
            seen[id(a)] = a.nbytes
    return sum(seen.values())


def arrays_bytes(trees: Iterable[Any]) -> int:
    """The bytes of the arrays in ``trees`` (each array once)."""
    seen: dict[int, int] = {}
    for tree in trees:
        for _, a in tree_flatten(tree):
            if isinstance(a, mx.array):
                seen[id(a)] = a.nbytes
    return sum(seen.values())


def _largest(pred: Callable[[int], bool], limit: int = 1 << 40) -> int:
    """The largest n >= 1 with ``pred(n)`` (``pred`` true up to some n, false
    after); 0 if ``pred(1)`` is false."""
    if not pred(1):
        return 0
    lo, hi = 1, 2
    while hi < limit and pred(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pred(mid) else (lo, mid)
    return lo


# -- reservations ---------------------------------------------------------------------
@dataclass(frozen=True)
class Reservation:
    """What one generation may grow to: ``prompt`` + ``max_tokens`` tokens in
    ``columns`` slots (with the slack of draft columns and allocation steps),
    forwards up to ``width`` positions, caches stored as ``kv``; its
    proposer's own models and caches (``own_models``, ``own_bytes``);
    ``restore``: a state the prompt cache's disk tier may read for it."""

    prompt: int
    max_tokens: int
    columns: int
    width: int
    kv: KVConfig = FULL_PRECISION
    own_models: tuple[Any, ...] = ()
    own_bytes: int = 0
    restore: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt + self.max_tokens


@dataclass(frozen=True)
class Need:
    """The bytes a set of live generations may hold, by kind."""

    weights: int
    kv: int
    own: int
    transient: int
    prompt_cache: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.own + self.transient + self.prompt_cache


@dataclass
class MemoryReport:
    """The ledger's numbers at the scheduler's last step (for metrics)."""

    budget: int = 0
    weights: int = 0
    kv_reserved: int = 0
    kv_in_use: int = 0
    transient: int = 0
    prompt_cache: int = 0
    waiting: int = 0  # requests waiting for memory
    fit_now: int = 0  # tokens one more request could reserve beside the live ones
    refusals: dict[str, int] = field(default_factory=dict)
    clamped: int = 0  # requests whose max_tokens was cut to what fits
    evictions: int = 0  # prompt-cache snapshots evicted to make room


#: Proposer's own memory for a context: (its models, its caches' bytes).
OwnMemory = Callable[[int], tuple[tuple[Any, ...], int]]


class MemoryPrices:
    """What one Target's generations cost, from shapes: the weights measured
    (each model once), a row's caches per KV layout, a reservation, the
    activations of a step's forwards, and :meth:`need`, all of it for a set
    of live generations (``prefill_chunk``: the scheduler's)."""

    def __init__(self, target: Any, prefill_chunk: int):
        self.target, self.chunk = target, prefill_chunk
        self.layers = target.layer_shapes()
        self.shape = ForwardShape.of(target, self.layers)
        self._weights: dict[int, int] = {id(target.model): model_bytes(target.model)}
        self._prices: dict[KVConfig, RowPrice] = {}

    @staticmethod
    def slack(width: int) -> int:
        """Slot columns a row may hold beyond its tokens: a verify's drafts
        (and the batch's room for the next forward) and two allocation steps."""
        return 2 * width + 2 * STEP

    def price(self, kv: KVConfig) -> RowPrice:
        """A row's caches stored as ``kv`` (a sliding window also holds a
        prefill chunk's or the widest verify's positions), priced once."""
        if kv not in self._prices:
            self._prices[kv] = RowPrice.of(self.layers, kv, max(self.chunk, MAX_WIDTH) + 2 * STEP)
        return self._prices[kv]

    def row(self, columns: int, kv: KVConfig) -> int:
        """One row's caches for ``columns`` positions stored as ``kv``."""
        return self.price(kv).bytes(columns)

    def weights(self, models: Iterable[Any] = ()) -> int:
        """The target's weights and those of ``models`` (each model measured once)."""
        held = {id(self.target.model): self.target.model, **{id(m): m for m in models}}
        for key, m in held.items():
            if key not in self._weights:
                self._weights[key] = model_bytes(m)
        return sum(self._weights[key] for key in held)

    def kept_models(self) -> list[Any]:
        """Models the Target keeps for later generations (draft models, drafters, draft heads)."""
        kept = self.target.kept
        return (
            [t.model for t in kept.draft_models.values()]
            + list(kept.drafters.values())
            + list(kept.draft_heads.values())
        )

    def reserve(
        self, prompt: int, max_tokens: int, kv: KVConfig, width: int = 1, own: OwnMemory | None = None
    ) -> Reservation:
        """The reservation of a generation of ``prompt`` + ``max_tokens`` tokens."""
        columns = prompt + max_tokens + self.slack(width)
        models, own_bytes = own(columns) if own is not None else ((), 0)
        cache = getattr(self.target, "prompt_cache", None)
        restore = self.row(prompt, kv) if cache is not None and cache.disk is not None else 0
        return Reservation(prompt, max_tokens, columns, width, kv, tuple(models), own_bytes, restore)

    def need(self, live: Sequence[Reservation], columns: int = 0, prompt_cache: bool = True) -> Need:
        """What ``live`` may hold together (a batch of ``columns`` columns now)."""
        models = [m for r in live for m in r.own_models]
        weights = self.weights([*self.kept_models(), *models])
        pc = self._prompt_cache_bytes() if prompt_cache else 0
        if not live:
            return Need(weights, 0, 0, 0, pc)
        n = len(live)
        cols = max(columns, max(r.columns for r in live))
        row = max(self.row(cols, kv) for kv in {r.kv for r in live})
        kv = n * row + (row if n > 1 else 0) + sum(r.restore for r in live)
        return Need(weights, kv, sum(r.own_bytes for r in live), self.transient(live, cols), pc)

    def layer(self, columns: int, kv: KVConfig) -> int:
        """The largest layer cache of a row of ``columns`` positions: what a
        cache growing (or a batch packing) copies while the old one lives."""
        return self.price(kv).largest(columns)

    def transient(self, live: Sequence[Reservation], columns: int) -> int:
        """Temporaries of the forwards a step may have in flight, each with
        one layer's cache copied as it grows: a prefill chunk against its
        prompt, a round of a generation alone against its reservation and
        (two or more live) a batched round of every row against the batch's
        ``columns``."""
        s, q = self.shape, any(r.kv.quantized for r in live)
        prefill = max(s.bytes(1, min(self.chunk, r.prompt), r.prompt + STEP, 0, q)
                      + self.layer(r.prompt + STEP, r.kv) for r in live)  # fmt: skip
        alone = max(s.bytes(1, r.width, r.columns, r.width, q) + self.layer(r.columns, r.kv) for r in live)
        if len(live) < 2:
            return prefill + alone
        n, width = len(live), max(r.width for r in live)
        batch = s.bytes(n, width, columns, n * width, q) + n * max(self.layer(columns, r.kv) for r in live)
        return prefill + alone + batch

    def _prompt_cache_bytes(self) -> int:
        cache = getattr(self.target, "prompt_cache", None)
        return cache.nbytes if cache is not None else 0

    def per_token(self, kv: KVConfig, tokens: int = 4096) -> float:
        """Bytes a reservation takes per token at ``tokens`` (KV of one row)."""
        return self.row(tokens, kv) / tokens


class MemoryLedger(MemoryPrices):
    """The accounting of one scheduler under a :class:`MemoryBudget`: the
    prices of :class:`MemoryPrices` held to the budget's total, admissions
    decided (prompt-cache snapshots evicted to make room), requests clamped
    or refused with the numbers, the numbers kept for metrics. Raises
    ``Hf2qError`` naming the budget when the model and one request's
    minimum do not fit."""

    def __init__(self, target: Any, budget: MemoryBudget, prefill_chunk: int):
        super().__init__(target, prefill_chunk)
        self.budget = budget
        self.total, self.source = budget.resolve()
        self._lock = threading.Lock()
        self.report = MemoryReport(budget=self.total, weights=self.weights())
        self.refusals: dict[str, int] = {}
        self.clamped = self.evictions = 0
        self.check_model()

    # -- how much fits ------------------------------------------------------------
    def fit(
        self,
        prompt: int,
        kv: KVConfig,
        live: Sequence[Reservation] = (),
        columns: int = 0,
        width: int = 1,
        own: OwnMemory | None = None,
    ) -> int:
        """The most tokens (prompt and answer) one more generation of a
        ``prompt``-token prompt may reserve beside ``live``, the prompt cache
        emptied; when not even one generated token fits, the most a shorter
        prompt and one token could (0: none)."""

        def fits(p: int, answer: int) -> bool:
            r = self.reserve(p, answer, kv, width, own)
            return self.need([*live, r], columns, prompt_cache=False).total <= self.total

        answer = _largest(lambda m: fits(prompt, m))
        if answer:
            return prompt + answer
        shorter = _largest(lambda p: p < prompt and fits(p, 1))
        return shorter + 1 if shorter else 0

    def clamp(self, prompt: int, max_tokens: int, kv: KVConfig, width: int = 1,
              own: OwnMemory | None = None) -> int:  # fmt: skip
        """``max_tokens`` cut to what fits alone (as the context clamp cuts
        it); a prompt that cannot fit with one token to generate is refused
        (:class:`MemoryRefused`, 413) with the numbers."""
        fits = self.fit(prompt, kv, width=width, own=own)
        if fits <= prompt:
            raise self.refusal(prompt, max_tokens, fits, kv)
        if prompt + max_tokens > fits:
            with self._lock:
                self.clamped += 1
            return fits - prompt
        return max_tokens

    def refusal(self, prompt: int, max_tokens: int, fits: int, kv: KVConfig) -> MemoryRefused:
        """The 413 of a prompt that cannot fit (``fits`` tokens would), counted."""
        self.count("prompt_too_long")
        return MemoryRefused(self._too_long(prompt, max_tokens, fits, kv), 413)

    def _too_long(self, prompt: int, max_tokens: int, fits: int, kv: KVConfig) -> str:
        least = self.need([self.reserve(prompt, 1, kv)], prompt_cache=False)
        return (
            f"prompt is too long for this server's memory: {prompt} prompt tokens plus {max_tokens} to "
            f"generate were asked, and at most {max(fits, 0)} tokens (prompt and answer) fit: the memory "
            f"budget ({self.source}) holds {format_bytes(least.weights)} of weights, and this prompt with "
            f"one token to generate needs {format_bytes(least.kv)} of KV ({self.per_token(kv):,.0f} bytes "
            f"per token) and {format_bytes(least.transient)} of activations (give a shorter prompt, or a "
            f"larger --memory-budget)"
        )

    def check_model(self) -> None:
        """Refuse a budget that cannot hold the weights and one request of one token."""
        r = self.reserve(1, 1, self.target.kv, width=1)
        need = self.need([r], prompt_cache=False)
        if need.total > self.total:
            raise Hf2qError(
                f"the memory budget ({self.source}) cannot hold this model: "
                f"its weights take {format_bytes(need.weights)} and one request needs at least "
                f"{format_bytes(need.total - need.weights)} more ({format_bytes(need.kv)} of KV for "
                f"{r.columns} positions, {format_bytes(need.transient)} of activations): give a larger "
                f"{self.budget.name}"
            )

    def limit_mlx(self) -> None:
        """Make MLX itself keep to the budget where it can:
        ``mx.set_memory_limit`` (while over it, MLX waits for the work in
        flight to free its buffers before it schedules more; on Metal its
        allocator gives back cached buffers before the total passes it)."""
        mx.set_memory_limit(self.total)

    # -- the queue ------------------------------------------------------------------
    def check_queue(self, prompt: int, max_tokens: int, kv: KVConfig, waiting: int) -> None:
        """Refuse one more request (429, with the numbers) when ``waiting``
        requests already wait for memory, ``max_waiting`` or more."""
        bound = self.budget.max_waiting
        if bound is None or waiting == 0 or waiting < bound:
            return
        self.count("queue_full")
        raise MemoryRefused(
            f"the server's memory is full: this request asks for {prompt + max_tokens} tokens (prompt "
            f"{prompt}, max_tokens {max_tokens}), {self.report.fit_now} tokens fit beside the generations "
            f"running, and {waiting} requests already wait for memory (at most {bound}); the "
            f"memory budget is {self.source}, {self.per_token(kv):,.0f} "
            f"bytes of KV per token: retry later",
            429,
        )

    def count(self, reason: str) -> None:
        """One more refusal for ``reason``."""
        with self._lock:
            self.refusals[reason] = self.refusals.get(reason, 0) + 1

    # -- the prompt cache ----------------------------------------------------------
    def make_room(
        self, live: Sequence[Reservation], columns: int, keep: Any = None, partly: bool = False
    ) -> bool:
        """Whether ``live`` fits, after evicting prompt-cache snapshots
        (least recently used first, never ``keep``) as far as it needs;
        ``partly``: evict even when that cannot make it fit (the budget is
        exceeded), else only when it makes it fit."""
        cache = getattr(self.target, "prompt_cache", None)
        need = self.need(live, columns)
        over = need.total - self.total
        if over <= 0 or cache is None:
            return over <= 0
        kept = keep.nbytes if keep is not None else 0
        if not partly and need.prompt_cache - kept < over:
            return False
        evicted = cache.evict(over, keep=keep)
        with self._lock:
            self.evictions += evicted
        return self.need(live, columns).total <= self.total

    def record(
        self, live: Sequence[Reservation], columns: int, in_use: int, waiting: int, fit_now: int
    ) -> None:
        """The numbers of this step, for metrics (read from other threads)."""
        need = self.need(live, columns)
        with self._lock:
            refusals, clamped, evictions = dict(self.refusals), self.clamped, self.evictions
        self.report = MemoryReport(self.total, need.weights, need.kv + need.own, in_use, need.transient,
                                   need.prompt_cache, waiting, fit_now, refusals, clamped, evictions)  # fmt: skip
