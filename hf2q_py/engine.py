"""The one speculative loop shared by every method: a short loop over one
:class:`~hf2q_py.sequence.Sequence` (the generation's state and its rounds);
the :class:`~hf2q_py.scheduler.Scheduler` runs many of them in batches."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from .draft_length import Policy
from .proposers.base import Proposer
from .sampling import Greedy
from .sequence import Sequence as Generation
from .stats import GenerationStats, Round
from .target import Target


def generate_tokens(
    target: Target,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    proposer: Proposer | None = None,
    policy: Policy | None = None,
    eos_token_ids: Sequence[int] = (),
    stats: GenerationStats | None = None,
    on_round: Callable[[Round], None] | None = None,
    decider: Greedy | None = None,
    plain_first_token: bool = False,
) -> Iterator[list[int]]:
    """Yield each round's newly committed tokens (see ``Sequence`` for the
    options). EOS ends generation (the EOS token itself is not yielded) and
    ``max_tokens`` is never exceeded, also inside an accepted block."""
    seq = Generation(
        target, prompt, max_tokens=max_tokens, proposer=proposer, policy=policy,
        eos_token_ids=eos_token_ids, stats=stats, on_round=on_round, decider=decider,
        plain_first_token=plain_first_token,
    )  # fmt: skip
    return run(seq)


def run(seq: Generation) -> Iterator[list[int]]:
    """Start ``seq`` and yield each round's committed tokens until it is done;
    closing the iterator between rounds leaves the caches whole."""
    whole = False
    seq.start()
    try:
        while not seq.done:
            new = seq.step()
            if new:
                try:
                    yield new
                except GeneratorExit:  # closed between rounds: the caches are whole
                    whole = True
                    raise
        whole = True
    finally:
        seq.close(keep=whole)
