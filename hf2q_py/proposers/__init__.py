"""Draft sources, one file each, all behind ``Proposer`` (see ``base.py``)."""

from .base import Proposer

__all__ = ["Proposer"]
