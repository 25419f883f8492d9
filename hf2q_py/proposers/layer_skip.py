"""Layer-skip self-speculation: the target drafts with some of its layers
skipped, then verifies with all of them. No second model, no extra weights.

The draft pass runs on the target's own cache: the layers it runs read the
full model's K/V of every committed token, and whatever it writes for the
draft positions is trimmed off again before verification. In a batch
(:class:`LayerSkipRows`) the rows that skip the same layers draft together:
each draft step is one partial forward of the batch's runtime, and the
batch is rewound to its state before drafting once the steps are queued.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..distributed import agree
from ..draft_length.batch import BatchCosts, DraftPlan, Pricing
from ..errors import Hf2qError
from ..taps import check_skip_set, check_skippable, embedding, find_decoder, language_model
from ..target import Target
from .base import Draft, DraftAsk, Proposer, ask_offer

MARGIN = 1.05  # a skip set is kept only if it beats plain decoding by this factor


def skip_recipe(spec: str | Sequence[int], num_layers: int) -> list[int]:
    """Layer indices to skip: an explicit list, ``"alternate"`` (every second
    layer, realizar's recipe), ``"early:N"`` (run the first N layers only,
    LayerSkip's early exit) or ``"middle:N"`` (skip N layers in the middle)."""
    if isinstance(spec, str):
        name, _, arg = spec.partition(":")
        if name == "alternate":
            layers = list(range(1, num_layers, 2))
        elif name in ("early", "middle"):
            try:
                n = int(arg)
            except ValueError:
                raise Hf2qError(f"skip recipe {spec!r} needs a layer count, e.g. {name}:8") from None
            if name == "early":
                if not 1 <= n < num_layers:
                    raise Hf2qError(f"early exit needs 1 <= N < {num_layers}, got {n}")
                layers = list(range(n, num_layers))
            else:
                if not 1 <= n <= num_layers - 2:
                    raise Hf2qError(f"middle skip needs 1 <= N <= {num_layers - 2}, got {n}")
                first = (num_layers - n) // 2
                layers = list(range(first, first + n))
        else:
            try:
                layers = [int(x) for x in spec.split(",") if x.strip()]
            except ValueError:
                raise Hf2qError(
                    f"bad skip layers {spec!r}: use a list like 3,5,7, alternate, early:N, middle:N or auto"
                ) from None
    else:
        layers = [int(x) for x in spec]
    if not layers:
        raise Hf2qError("the skip set is empty")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise Hf2qError(f"skip layers {bad} are out of range for a {num_layers}-layer model")
    if len(set(layers)) == num_layers:
        raise Hf2qError("cannot skip every layer")
    return sorted(set(layers))


def auto_candidates(num_layers: int) -> list[list[int]]:
    """Skip sets that ``auto`` measures, most promising first: middle blocks
    (the layers a model misses least) and early exit at two thirds. Skipping
    every second layer is left out: it drafts almost nothing right."""
    cands = []
    for frac in (0.2, 0.3):
        n = max(1, round(num_layers * frac))
        if n <= num_layers - 2:
            cands.append(skip_recipe(f"middle:{n}", num_layers))
    if num_layers >= 3:
        cands.append(skip_recipe(f"early:{max(1, (2 * num_layers) // 3)}", num_layers))
    unique = []
    for c in cands:
        if c not in unique:
            unique.append(c)
    return unique


def draft_cost_share(model, skip: Sequence[int]) -> float:
    """Cost of a skip pass relative to a full single-token forward, taken as
    the share of weight bytes it reads (batch-1 decoding is bandwidth-bound):
    the layers it runs plus the output head, which is never skipped."""
    model = language_model(model)
    sizes = [sum(v.nbytes for _, v in tree_flatten(layer.parameters())) for layer in model.layers]
    head = getattr(model, "lm_head", None)
    if head is None:  # tied: the embedding is the head
        head = embedding(find_decoder(model))
    head_bytes = sum(v.nbytes for _, v in tree_flatten(head.parameters()))
    total = sum(sizes) + head_bytes
    return (total - sum(sizes[i] for i in set(skip))) / total


def optimistic_speedup(draft_share: float, verify_cost, k_max: int, acceptance: float) -> float:
    """Speed-up over plain decoding of a skip set whose drafts are each
    accepted with probability ``acceptance``, at the best K <= ``k_max``:
    expected tokens ``sum_{i<=K} acceptance**i`` per round of K skip passes
    plus one verify of K+1 tokens (``verify_cost(n)`` in single-forward units)."""
    return max(
        sum(acceptance**i for i in range(k + 1)) / (k * draft_share + verify_cost(k + 1))
        for k in range(1, k_max + 1)
    )


def _valid(model, skip: Sequence[int]) -> bool:
    try:
        check_skip_set(model, skip)
    except Hf2qError:
        return False
    return True


class LayerSkipProposer(Proposer):
    """Drafts with the target itself, some layers skipped.

    With ``skip="auto"`` the first rounds of a generation try each candidate
    skip set (and plain decoding) for a few rounds each, on the real output,
    then keep the one with the best measured tokens per second, or none at all
    when no skip set beats plain decoding. Before that, candidates that would
    not beat plain decoding by ``MARGIN`` even if every draft were accepted
    (``optimistic_acceptance``; 100% happens: the 1.5B Qwen coder accepted
    every draft of a 6-layer middle skip while copying code) are dropped
    untried, from their share of the weights against a verify timed right
    after prefill; when none is left there is no calibration.
    The choice is kept on the target (``target.kept.skip_sets``), so later
    generations with ``auto`` start from it. One generation calibrates at a
    time (``target.kept.calibrating``): one that starts while another
    calibrates decodes plainly.
    """

    name = "layerskip"
    uses_target_cache = True
    lazy_drafts = True

    def __init__(
        self,
        target: Target,
        skip: str | Sequence[int] = "auto",
        trial_rounds: int = 3,
        optimistic_acceptance: float = 1.0,
        k_max: int = 8,
    ):
        check_skippable(target.model)
        self.target = target
        self.rt = None
        n = target.num_layers
        self.skip: list[int] | None
        # auto: plain decoding first (the yardstick), then each candidate
        self.trials: list[list[int] | None] = []
        if skip == "auto":
            if "auto" in target.kept.skip_sets:
                self.skip = target.kept.skip_sets["auto"]
            else:
                self.trials = [None, *[c for c in auto_candidates(n) if _valid(target.model, c)]]
                self.skip = None
        else:
            self.skip = skip_recipe(skip, n)
            check_skip_set(target.model, self.skip)
        self.trial_rounds = trial_rounds
        self.optimistic_acceptance = optimistic_acceptance
        self.k_max = k_max
        self.pruned: list[tuple[list[int], float]] = []  # (skip set, optimistic speed-up)
        self.results: list[tuple[list[int] | None, float]] = []  # (skip set, tokens/s)
        self._rounds = self._tokens = 0
        self._seconds = 0.0
        self._t_last = 0.0

    # -- auto calibration ------------------------------------------------------
    def _remember(self, skip: list[int] | None) -> None:
        self.target.kept.skip_sets["auto"] = skip
        self._release()

    def _claim(self) -> None:
        """Calibrate only while no other generation on the target does: one
        that starts meanwhile decodes plainly (and can be a batch row) for
        its whole length; one that starts after a choice takes it."""
        kept = self.target.kept
        if "auto" in kept.skip_sets:
            self.skip, self.trials = kept.skip_sets["auto"], []
        elif kept.calibrating.get("auto", self) is not self:
            self.skip, self.trials = None, []
        else:
            kept.calibrating["auto"] = self

    def _release(self) -> None:
        if self.target.kept.calibrating.get("auto") is self:
            del self.target.kept.calibrating["auto"]

    def _account(self, committed: int, seconds: float) -> None:
        """Measure the skip set on trial: a candidate is dropped after its first
        round if that round was slower than plain decoding, else measured over
        ``trial_rounds``; the fastest is kept if it beats plain decoding by 5%."""
        self._rounds += 1
        self._tokens += committed
        self._seconds += seconds
        rate = self._tokens / max(self._seconds, 1e-9)
        plain = self.results[0][1] if self.results else None
        slow = plain is not None and self._rounds == 1 and rate < plain
        if self._rounds < self.trial_rounds and not slow:
            return
        self.results.append((self.trials.pop(0), rate))
        self._rounds = self._tokens = 0
        self._seconds = 0.0
        if self.trials:
            self.skip = self.trials[0]
            return
        plain_rate = self.results[0][1]
        best = max(self.results[1:], key=lambda r: r[1], default=(None, 0.0))
        self.skip = best[0] if best[1] > MARGIN * plain_rate else None
        self._remember(self.skip)

    # -- Proposer --------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.skip is not None or bool(self.trials)

    @property
    def batchable(self) -> bool:
        """Once calibrated: ``auto`` measures its candidates on a generation's
        own rounds, alone; then the skip set it keeps drafts in the batch."""
        return not self.trials

    def batch_drafter(self, batch: Any) -> tuple[Hashable, Callable[[], LayerSkipRows]] | None:
        """Rows skipping the same layers draft together (none: plain decoding, no drafter)."""
        if self.skip is None:
            return None
        skip = list(self.skip)
        return ("layerskip", tuple(skip)), lambda: LayerSkipRows(batch, skip, self.target.model)

    def move(self, runtime: Any) -> None:
        self.rt = runtime

    def _prune(self, last_token: int) -> None:
        """Drop the trial candidates that could not pay even optimistically."""

        def forward_seconds(n: int) -> float:
            t0 = time.perf_counter()
            mx.eval(self.rt.forward([last_token] * n).logits)
            seconds = time.perf_counter() - t0
            self.rt.trim(n)
            return seconds

        forward_seconds(1)  # warm-up
        one, wide = self._agreed(forward_seconds(1), forward_seconds(self.k_max + 1))
        slope = max(0.0, wide / one - 1) / self.k_max

        def verify_cost(n: int) -> float:
            return 1 + slope * (n - 1)

        kept = []
        for skip in self.trials[1:]:
            share = draft_cost_share(self.target.model, skip)
            bound = optimistic_speedup(share, verify_cost, self.k_max, self.optimistic_acceptance)
            if bound >= MARGIN:
                kept.append(skip)
            else:
                self.pruned.append((skip, bound))
        self.trials = [None, *kept] if kept else []
        if not kept:
            self._remember(None)

    def _agreed(self, *seconds: float) -> list[float]:
        """Measured ``seconds`` as every rank of a sharded target takes them: rank 0's."""
        sharding = self.target.sharding
        return list(seconds) if sharding is None else agree(sharding, seconds)

    def start(self, runtime, prompt, hidden, decider) -> None:
        self.decider = decider
        self.rt = runtime
        if self.trials:
            self._claim()
        if self.trials:
            self._prune(prompt[-1])
        self._t_last = time.perf_counter()
        self._last_len = len(prompt)

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        if self.skip is None:
            return Draft()
        if self.rt.offset != len(tokens) - 1:
            raise RuntimeError("layer-skip drafting needs the target cache at the last committed token")
        y = mx.array(tokens[-1], dtype=mx.uint32)
        steps, dists = [], []
        for i in range(k):
            logits = self.rt.forward(y.reshape(1, 1), skip_layers=self.skip).logits[-1]
            y, q = self.decider.draft_token(logits, tokens, i)
            steps.append(y)
            dists.append(q)
            mx.async_eval(y)
        draft = Draft(mx.stack(steps), mx.stack(dists) if dists[0] is not None else None)
        self.rt.trim(k, self.skip)  # remove every draft position before verification
        return draft

    def update(self, tokens, drafted, accepted, hidden) -> None:
        now = time.perf_counter()
        if self.trials:
            (seconds,) = self._agreed(now - self._t_last)
            self._account(len(tokens) - self._last_len, seconds)
        self._last_len, self._t_last = len(tokens), now

    def finish(self, tokens) -> None:
        self._release()  # a calibration cut short: the next generation measures


class LayerSkipRows:
    """Drafts for the rows of a batch (a ``BatchRuntime``) whose proposers
    skip the layers ``skip``: each step one partial forward of the batch,
    one position per drafting row (the other rows feed nothing), each row's
    draft chosen by its own decider; then the batch is rewound
    (``BatchRuntime.rewind``: every layer's draft positions emptied, the
    recurrent states as before), so the verify finds the committed tokens
    only. Drafts stay lazy. How many steps run is the ``DraftPlan``'s
    choice at the batch's measured costs, each step costing
    ``draft_cost_share`` of a decode of the rows."""

    def __init__(self, batch: Any, skip: Sequence[int], model: Any):
        self.batch, self.skip = batch, list(skip)
        self.plan = DraftPlan(
            step_cost=draft_cost_share(model, self.skip),
            costs=batch.costs or BatchCosts(),
            ragged=batch.ragged,
        )
        self.rows: dict[Hashable, LayerSkipProposer] = {}

    def join(self, row: Hashable, proposer: LayerSkipProposer) -> None:
        self.rows[row] = proposer

    def leave(self, row: Hashable, proposer: LayerSkipProposer) -> None:
        self.rows.pop(row, None)

    def unread_seconds(self, costs: BatchCosts) -> float:
        """Not estimated: its lazy drafts' forwards count in the verify's
        measured cost (so the batch's costs lean towards fewer drafts)."""
        return 0.0

    def propose(self, asks: Sequence[DraftAsk], pricing: Pricing | None = None) -> list[Draft]:
        n = self.plan.drafts([ask_offer(a) for a in asks], pricing.others if pricing is not None else ())
        index = {row: b for b, row in enumerate(self.batch.rows)}
        feeds: list[Any] = [mx.array([a.tokens[-1]], dtype=mx.uint32) for a in asks]
        steps: list[list[mx.array]] = [[] for _ in asks]
        dists: list[list[mx.array | None]] = [[] for _ in asks]
        mark = self.batch.mark()
        try:
            for i in range(n):
                live = [j for j, a in enumerate(asks) if a.k > i]
                row_feeds: list[Any] = [[] for _ in index]
                for j in live:
                    row_feeds[index[asks[j].row]] = feeds[j]
                fwd = self.batch.forward(row_feeds, skip_layers=self.skip)
                for j in live:
                    a = asks[j]
                    y, q = a.proposer.decider.draft_token(fwd.logits[fwd.index(index[a.row]), 0], a.tokens, i)
                    feeds[j] = y.reshape(1)
                    steps[j].append(y)
                    dists[j].append(q)
                mx.async_eval([steps[j][-1] for j in live])
        finally:
            self.batch.rewind(mark)
        return [_draft(s, d) for s, d in zip(steps, dists)]


def _draft(steps: list[mx.array], dists: list[mx.array | None]) -> Draft:
    if not steps:
        return Draft()
    return Draft(mx.stack(steps), mx.stack(dists) if dists[0] is not None else None)


def build(target: Target, spec) -> LayerSkipProposer:
    """The layerskip method's proposer (method table); no skip set means ``auto``."""
    skip = spec.skip_layers if spec.skip_layers is not None else "auto"
    return LayerSkipProposer(target, skip, k_max=spec.draft_length)
