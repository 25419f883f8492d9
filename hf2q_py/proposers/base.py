"""The one interface every draft source implements, and the record it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Callable, Hashable, Sequence

from ..draft_length.batch import Offer
from ..draft_length.profile import DraftProfile

if TYPE_CHECKING:
    import mlx.core as mx

    from ..draft_length.batch import BatchCosts, Offer, Pricing


@dataclass
class Draft:
    """Draft tokens for one round: token ids, or a lazy (k,) array of them
    (drafts from a model: the engine feeds them to the verify unread and
    reads them with its result). ``probs``: the (len(tokens), vocab)
    distributions they were drawn from, or None for point masses (argmax
    drafts, n-gram copies). ``catch_up``: committed tokens the proposer read
    before drafting them (a draft model feeding what it has not seen).
    ``key``: the draft key of its source when a batch drafter made it from
    another source than the round's key names (copies where a draft model
    drafts none); None: the round's."""

    tokens: list[int] | mx.array = field(default_factory=list)
    probs: mx.array | None = None
    catch_up: int = 0
    key: Hashable = None
    #: Lazy tokens' ids once the engine has read them with their verify.
    values: list[int] | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0] if self.lazy else len(self.tokens)

    @property
    def lazy(self) -> bool:
        """Whether the tokens are a lazy array, not yet read."""
        return not isinstance(self.tokens, list)

    def ids(self) -> list[int]:
        """The token ids (lazy tokens are read, unless the engine already did)."""
        if not self.lazy:
            return list(self.tokens)
        return list(self.values) if self.values is not None else self.tokens.tolist()

    def head(self, k: int) -> Draft:
        """The first ``k`` drafts (this draft itself when it has no more)."""
        if k >= len(self):
            return self
        return Draft(self.tokens[:k], None if self.probs is None else self.probs[:k], self.catch_up, self.key)

    def tail(self) -> Draft:
        """All drafts but the first (what stays valid once the first is confirmed);
        its catch-up was already counted with the whole draft."""
        return Draft(self.tokens[1:], None if self.probs is None else self.probs[1:], key=self.key)


class Proposer:
    """Proposes draft tokens for the target to verify.

    The engine calls ``start`` once after prefill, then per round
    ``draft_key(tokens)`` (to choose K), ``propose(tokens, k)`` with every
    committed token so far (prompt included), ``update`` after each round
    with how many drafts were accepted, and ``finish`` when generation ends.
    ``capture_layers`` names target layers whose hidden states the proposer
    wants; the engine captures them in the target's own forwards and passes
    them to ``start`` and ``update``.
    """

    name = "proposer"
    capture_layers: tuple[int, ...] = ()
    #: True when drafting runs on the target's own KV cache (layer skip): the
    #: engine then never proposes while a target decode is in flight.
    uses_target_cache = False
    #: True when drafts are lazy arrays from a model (``Draft.lazy``): the engine
    #: then never drafts while a target decode is in flight (judging such
    #: drafts against the decode's token would cost a read).
    lazy_drafts = False
    #: True when its generation's rounds can share a batch's verify: it
    #: drafts on the host (copies), or its ``batch_drafter`` drafts for all
    #: such rows at once. False: the generation runs alone beside the batch.
    batchable = True

    def batch_drafter(self, batch: Any) -> tuple[Hashable, Callable[[], BatchDrafter]] | None:
        """How this proposer drafts as a row of ``batch`` (the target's
        ``BatchRuntime``): None, on the host, one row at a time (``propose``);
        else a key that proposers drafting together share, and a factory for
        their ``BatchDrafter`` (made once per key while rows use it)."""
        return None

    def goes_alone(self, tokens: Sequence[int]) -> bool:
        """Whether its generation, the last row of a batch, may go on alone
        (pipelined) after ``tokens``: False while it would first read, unpriced,
        what its batch drafter's planner kept it from reading (a draft model
        behind the copies its row took); the generation then stays a batch row."""
        return True

    #: What the proposer knows about its drafts (priors per draft key, drafting
    #: cost, minimum K): the draft-length policy is made from it.
    profile = DraftProfile()

    def own_memory(self, tokens: int) -> tuple[tuple[Any, ...], int]:
        """The models it drafts with besides the target (whose weights a
        memory budget counts once) and the bytes its own caches may take
        for a context of ``tokens``; none for proposers that draft on the host
        or on the target's cache."""
        return (), 0

    @property
    def active(self) -> bool:
        """False once the proposer has decided not to draft at all (the
        engine then decodes plainly, pipelined, without asking it)."""
        return True

    def draft_key(self, tokens: Sequence[int]) -> Hashable:
        """A class for the next drafts, known before drafting (the n-gram match
        depth); adaptive K keeps acceptance statistics per class. None: one class."""
        return None

    def start(self, runtime: Any, prompt: Sequence[int], hidden: dict[int, Any], decider: Any) -> None:
        """Called once, after the prompt (all but its last token) was prefilled.
        ``decider`` chooses tokens (greedy or sampling): proposers that draft
        with a model draw with ``decider.draft_token``."""

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        """Up to ``k`` (>= 1) draft tokens to follow ``tokens``; an empty Draft for none."""
        raise NotImplementedError

    def update(self, tokens: Sequence[int], drafted: int, accepted: int, hidden: dict[int, Any]) -> None:
        """After a round: ``tokens`` now holds every committed token; ``hidden``
        the captured states of the round's target forward (positions of the
        inputs, accepted ones first)."""

    def finish(self, tokens: Sequence[int]) -> None:
        """Called once when generation ends (also when it is stopped early),
        with every committed token, prompt included."""

    def move(self, runtime: Any) -> None:
        """Its generation goes on with another runtime holding the same state
        (a batch's row, or a runtime of its own again): a proposer that
        drafts on the target's cache (``uses_target_cache``) follows it."""


class PlainDecoding(Proposer):
    """No drafts: the engine decodes one token per round (the baseline)."""

    name = "baseline"

    @property
    def active(self) -> bool:
        return False

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        return Draft()


@dataclass
class DraftAsk:
    """One row's request to a ``BatchDrafter``: up to ``k`` drafts after
    ``tokens``; ``offer``: those ``k`` drafts as the batch's planner prices
    them (its policy's survival for the row's draft key); ``price``: how it
    prices ``n`` drafts of another key (a fallback's)."""

    row: Hashable
    proposer: Proposer
    tokens: Sequence[int]
    k: int
    offer: Offer | None = None
    price: Callable[[Hashable, int], Offer] | None = None


def ask_offer(ask: DraftAsk) -> Offer:
    """An ask's drafts as the batch's planner prices them (without an offer: a fixed K)."""
    return ask.offer if ask.offer is not None else Offer(ask.k, fixed=True)


class BatchDrafter(Protocol):
    """Drafts for the batch's rows whose proposers share it, with forwards it
    runs for all of them at once (a draft model's batched steps, a block
    drafter's batched forward, the target's partial forwards)."""

    def join(self, row: Hashable, proposer: Proposer) -> None:
        """A row joins the batch: its proposer's drafting state moves in."""
        ...

    def leave(self, row: Hashable, proposer: Proposer) -> None:
        """A row leaves the batch: its proposer can draft alone again (or finish)."""
        ...

    def propose(self, asks: Sequence[DraftAsk], pricing: Pricing | None = None) -> list[Draft]:
        """Each ask's drafts (lazy arrays or ids), made together; with
        ``pricing`` (the batch's costs and its other rows' offers), as many
        steps as pay for the whole round (``draft_length.batch.plan_steps``)."""
        ...

    def unread_seconds(self, costs: BatchCosts) -> float:
        """What the forwards its last ``propose`` queued without reading still
        cost when it returned (they compute within the round's verify; in
        ``costs``' units)."""
        ...
