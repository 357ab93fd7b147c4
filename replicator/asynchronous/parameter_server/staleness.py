"""The staleness record: how many server updates each applied gradient lagged, against the bound."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["StalenessRecord"]


@dataclass
class StalenessRecord:
    """Staleness of every gradient a server applied (seen from the worker or the server), and waits."""

    bound: int | None
    values: list[int] = field(default_factory=list)
    updates: int = 0  # optimizer steps this process took part in
    wait_seconds: float = 0.0  # blocked on servers (push, pull, the final exchange)

    def add(self, staleness: int) -> None:
        self.values.append(staleness)

    @property
    def exceeded(self) -> int:
        """Gradients applied further behind than the bound: zero, or the regime is broken."""
        return 0 if self.bound is None else sum(v > self.bound for v in self.values)

    def summary(self) -> dict[str, Any]:
        """min, median, p95 and max of the staleness, how many exceeded the bound, and the waits."""
        staleness: dict[str, Any] = {"bound": self.bound, "count": len(self.values), "exceeded": self.exceeded}
        if self.values:
            values = torch.tensor(self.values, dtype=torch.float64)
            staleness.update(min=int(values.min()), median=float(values.median()),
                             p95=float(torch.quantile(values, 0.95)), max=int(values.max()))
        return {"updates": self.updates, "wait_seconds": self.wait_seconds, "staleness": staleness}
