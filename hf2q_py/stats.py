"""Generation statistics: one dataclass per generation, filled by the engine."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Hashable


@dataclass
class Round:
    """One round after prefill: what the loop did and measured, as the
    statistics, the draft-length policy and the ``on_round`` hook see it.

    A round is one target forward: a single-token decode (``drafted`` 0) or a
    batched verify of ``drafted + 1`` tokens. ``cost_seconds``: wall time
    from when its forward could start (for a verify, from drafting; for a
    pipelined decode, when the decode before it was read) to when its
    result was read.
    """

    index: int = 0
    k: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    key: Hashable = None
    cost_seconds: float = 0.0
    propose_seconds: float = 0.0  # drafting (and drafts tried) since the round before
    verify_seconds: float = 0.0
    sample_seconds: float = 0.0
    catch_up: int = 0  # committed tokens the proposer read before drafting (a draft model's catch-up)
    predrafted: bool = False  # its drafts were made during the decode before it (timed there)
    restarted: bool = False  # a decode not overlapped with the round before it (not pipelined)
    chain_end: bool = False  # a pipelined decode that queued no next decode (its timing is partial)
    early_key: Hashable = None  # the key of drafts made while this decode ran ...
    early_rejected: int = 0  # ... and how many, when this decode's token rejected the first

    @property
    def forward_tokens(self) -> int:
        """Tokens the round's target forward fed: the last token plus the drafts."""
        return self.drafted + 1


@dataclass
class GenerationStats:
    """Counts and timings of one generation.

    A *round* is one target forward after prefill: a single-token decode when
    nothing was proposed (``empty_proposals``), else one batched verify.
    """

    method: str = "baseline"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose states came from the Target's prompt cache
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    rounds: int = 0
    empty_proposals: int = 0
    drafted: int = 0
    accepted: int = 0
    propose_seconds: float = 0.0
    verify_seconds: float = 0.0
    sample_seconds: float = 0.0
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    finish_reason: str = ""

    @property
    def verify_rounds(self) -> int:
        return self.rounds - self.empty_proposals

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """vLLM's definition: 1 + accepted drafts per verify round."""
        return 1.0 + self.accepted / self.verify_rounds if self.verify_rounds else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Share of drafts accepted at draft position i, among rounds that drafted it."""
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    def record(self, r: Round) -> None:
        """Count one round (numbered here: ``r.index`` is set)."""
        self.rounds += 1
        r.index = self.rounds
        self.propose_seconds += r.propose_seconds
        self.verify_seconds += r.verify_seconds
        self.sample_seconds += r.sample_seconds
        drafted, accepted = r.drafted, r.accepted
        if drafted == 0:
            self.empty_proposals += 1
            return
        self.drafted += drafted
        self.accepted += accepted
        while len(self.position_drafted) < drafted:
            self.position_drafted.append(0)
            self.position_accepted.append(0)
        for i in range(drafted):
            self.position_drafted[i] += 1
            if i < accepted:
                self.position_accepted[i] += 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in (
            "acceptance_rate",
            "mean_accepted_length",
            "per_position_acceptance",
            "tokens_per_second",
            "prefill_tokens_per_second",
            "verify_rounds",
        ):
            d[name] = getattr(self, name)
        return d

    def summary(self) -> str:
        s = f"{self.generated_tokens} tokens, {self.tokens_per_second:.1f} tok/s"
        if self.drafted:
            s += (
                f", acceptance {self.acceptance_rate:.0%}, "
                f"mean accepted length {self.mean_accepted_length:.2f}"
            )
        return s
