"""Internal: N-step transition assembly on the actor side (Acme's NStepTransitionAdder, without the replay client)."""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch

from replicator.asynchronous.actor_learner.transitions import Transition

__all__ = ["NStepAdder"]


class _Step(NamedTuple):
    observation: torch.Tensor
    action: torch.Tensor
    reward: float
    next_observation: torch.Tensor


class NStepAdder:
    """Turns one environment step at a time into N-step transitions.

    Once N steps are in the window, each new step releases the transition that starts N steps
    back: its reward is sum_k gamma^k r_k over the N steps, its discount gamma^N and its next
    observation the one N steps later. An episode's end releases every transition still in the
    window, each with the rewards up to the end: after `terminated` the discount is 0 (there is
    no value to bootstrap from), after `truncated` it is gamma^k for the k steps left (the
    episode was cut, the state still has a value).
    """

    def __init__(self, n_step: int, discount: float) -> None:
        self.n_step, self.gamma = n_step, discount
        self.window: deque[_Step] = deque()

    def add(self, observation: torch.Tensor, action: torch.Tensor, reward: float, next_observation: torch.Tensor,
            terminated: bool, truncated: bool) -> list[Transition]:
        """The transitions this step completes (none, one, or the episode's last ones)."""
        self.window.append(_Step(observation, action, reward, next_observation))
        released: list[Transition] = []
        if terminated or truncated:
            while self.window:
                released.append(self._first(terminated))
                self.window.popleft()
        elif len(self.window) == self.n_step:
            released.append(self._first(False))
            self.window.popleft()
        return released

    def _first(self, terminated: bool) -> Transition:
        """The transition that starts at the window's first step and runs to its last."""
        total, weight = 0.0, 1.0
        for step in self.window:
            total += weight * step.reward
            weight *= self.gamma
        first, last = self.window[0], self.window[-1]
        return Transition(first.observation, first.action, total, 0.0 if terminated else weight,
                          last.next_observation)

    def reset(self) -> None:
        """Forget a partial window (the run ended mid-episode)."""
        self.window.clear()
