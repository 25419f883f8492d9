"""How a loader splits the model it builds over a distributed group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..distributed import Sharding, plan, shard_model


@dataclass(frozen=True)
class Split:
    """A request to shard over ``group`` by ``mode`` (a ``--shard`` choice)."""

    group: Any
    mode: str

    def plan(self, cfg: dict[str, Any]) -> str:
        """The mode this model shards by; refuses before any weight is read."""
        return plan(cfg, self.mode, self.group.size())

    def apply(self, model: Any, cfg: dict[str, Any]) -> Sharding:
        """Shard ``model``, whose weights should not be evaluated yet."""
        return shard_model(model, self.group, self.plan(cfg))
