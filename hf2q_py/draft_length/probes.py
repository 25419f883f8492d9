"""When to try drafting again after the policy stood down (K = 0)."""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The longest wait between probes of a proposer whose drafts keep failing.
MAX_COOLDOWN = 4096


@dataclass
class ProbeSchedule:
    """A short probe of ``probe_k`` drafts after ``cooldown`` plain rounds; the
    cool-down doubles (up to ``max_cooldown``) while probes keep failing, and
    is at least what keeps failed probes below ``probe_budget`` of the
    decode time, given what one costs (``excess``, in decodes). A probe that
    makes drafting pay again resets it to ``min_cooldown``."""

    probe_k: int = 2
    min_cooldown: int = 8
    max_cooldown: int = 128  # the doubling's cap; a costly probe may wait longer (see probe_budget)
    probe_budget: float = 0.015  # the share of decode time failed probes may cost
    cooldown: int = 8
    since_probe: int = 0

    def due(self) -> bool:
        return self.since_probe >= self.cooldown

    def tick(self) -> None:
        """One more round without drafts."""
        self.since_probe += 1

    def probed(self, paid: bool, excess: float) -> None:
        """A probe's outcome: whether drafting pays now; ``excess``: what a
        failed attempt costs, in decodes."""
        self.since_probe = 0
        if paid:
            self.cooldown = self.min_cooldown
            return
        floor = math.ceil(excess / self.probe_budget)
        self.cooldown = max(min(self.cooldown * 2, self.max_cooldown), min(floor, MAX_COOLDOWN))
