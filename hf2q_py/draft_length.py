"""How many tokens to draft each round: a fixed K, or an adaptive K chosen
from measured acceptance and measured verify cost."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import Hf2qError


def validate_k(k: int) -> None:
    if not isinstance(k, int) or k < 1:
        raise Hf2qError(f"k (draft length) must be an integer >= 1, got {k!r}")


class FixedK:
    """Always draft up to ``k`` tokens."""

    def __init__(self, k: int):
        validate_k(k)
        self.k = k

    def next_k(self) -> int:
        return self.k

    def update(self, forward_tokens: int, seconds: float, drafted: int, accepted: int) -> None:
        pass


@dataclass
class AdaptiveK:
    """Chooses K in [0, k_max] to maximise expected tokens per second.

    With per-token acceptance ``a`` (a geometric model, estimated with decay
    from recent rounds), K drafts yield ``(1 - a**(K+1)) / (1 - a)`` tokens per
    round at a cost ``c(K+1)``: the measured time of a (K+1)-token forward
    relative to a 1-token one (a prior until measured). K = 0 means plain
    decoding; then a short probe round runs after a cool-down that doubles
    while probes keep failing, so a workload where drafts never pay runs at
    plain-decoding speed.
    """

    k_max: int
    decay: float = 0.85
    prior_slope: float = 0.12  # c(L) = 1 + slope * (L - 1) until measured
    probe_k: int = 2
    min_cooldown: int = 8
    max_cooldown: int = 128
    accepted_w: float = 1.0
    rejected_w: float = 1.0
    times: dict[int, float] = field(default_factory=dict)
    cooldown: int = 8
    since_probe: int = 0

    def __post_init__(self):
        validate_k(self.k_max)

    @property
    def acceptance(self) -> float:
        return self.accepted_w / (self.accepted_w + self.rejected_w)

    def cost(self, n: int) -> float:
        t1 = self.times.get(1)
        tn = self.times.get(n)
        if t1 and tn:
            return tn / t1
        return 1.0 + self.prior_slope * (n - 1)

    def best_k(self) -> int:
        a = min(self.acceptance, 0.999)
        best, best_rate = 0, 1.0
        for k in range(1, self.k_max + 1):
            rate = (1 - a ** (k + 1)) / (1 - a) / self.cost(k + 1)
            if rate > best_rate * 1.02:
                best, best_rate = k, rate
        return best

    def next_k(self) -> int:
        k = self.best_k()
        if k > 0:
            return k
        if self.since_probe >= self.cooldown:
            return self.probe_k
        return 0

    def update(self, forward_tokens: int, seconds: float, drafted: int, accepted: int) -> None:
        old = self.times.get(forward_tokens)
        self.times[forward_tokens] = seconds if old is None else 0.8 * old + 0.2 * seconds
        if drafted == 0:
            self.since_probe += 1
            return
        probing = self.best_k() == 0
        self.accepted_w = self.decay * self.accepted_w + accepted
        self.rejected_w = self.decay * self.rejected_w + (1 if accepted < drafted else 0)
        if probing:
            self.since_probe = 0
            if self.best_k() == 0:
                self.cooldown = min(self.cooldown * 2, self.max_cooldown)
            else:
                self.cooldown = self.min_cooldown
