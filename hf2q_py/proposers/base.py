"""The one interface every draft source implements."""

from __future__ import annotations

from typing import Any, Hashable, Sequence


class Proposer:
    """Proposes draft tokens for the target to verify.

    The engine calls ``start`` once after prefill, then per round
    ``draft_key(tokens)`` (to choose K), ``propose(tokens, k)`` with every
    committed token so far (prompt included), and ``update`` after
    verification with how many of the drafts were accepted, and ``finish``
    when generation ends. ``capture_layers`` names target layers whose hidden states
    the proposer wants; the engine captures them in the target's own forwards
    and passes them to ``start`` and ``update``.
    """

    name = "proposer"
    capture_layers: tuple[int, ...] = ()
    #: True when drafting runs on the target's own KV cache (layer skip): the
    #: engine then never proposes while a target decode is in flight.
    uses_target_cache = False
    #: Set by the engine before ``start``: how tokens are chosen (greedy or
    #: sampling); proposers that draft with a model use ``decider.draft_token``.
    decider = None
    #: After ``propose``: the (K, vocab) distributions the drafts were drawn
    #: from, or None for point masses (argmax drafts, n-gram copies).
    draft_probs = None

    @property
    def active(self) -> bool:
        """False once the proposer has decided not to draft at all (the
        engine then decodes plainly, pipelined, without asking it)."""
        return True

    def draft_key(self, tokens: Sequence[int]) -> Hashable:
        """A class for the next drafts, known before drafting (the n-gram match
        depth); adaptive K keeps acceptance statistics per class. None: one class."""
        return None

    def start(self, runtime: Any, prompt: Sequence[int], hidden: dict[int, Any]) -> None:
        """Called once, after the prompt (all but its last token) was prefilled."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` (>= 1) draft tokens to follow ``tokens``; [] for none."""
        raise NotImplementedError

    def update(
        self, tokens: Sequence[int], drafted: int, accepted: int, hidden: dict[int, Any]
    ) -> None:
        """After a round: ``tokens`` now holds every committed token; ``hidden``
        the captured states of the round's target forward (positions of the
        inputs, accepted ones first)."""

    def finish(self, tokens: Sequence[int]) -> None:
        """Called once when generation ends (also when it is stopped early),
        with every committed token, prompt included."""
