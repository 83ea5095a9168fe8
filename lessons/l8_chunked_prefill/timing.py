"""When each request got its tokens, in engine steps and in seconds: time to first token (TTFT) and every
inter-token gap (ITL). The engine stamps each token as it is sampled; L9's server reports these."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    arrival_step: int  # the engine's clock when the request was submitted (its first step is the next one)
    arrival_s: float
    token_steps: list[int] = field(default_factory=list)  # the step each output token was sampled in
    token_s: list[float] = field(default_factory=list)  # the time that step ended

    def stamp(self, step: int, now: float) -> None:
        self.token_steps.append(step)
        self.token_s.append(now)

    @property
    def ttft_steps(self) -> int | None:
        return self.token_steps[0] - self.arrival_step if self.token_steps else None

    @property
    def ttft_s(self) -> float | None:
        return self.token_s[0] - self.arrival_s if self.token_s else None

    @property
    def gap_steps(self) -> list[int]:
        """Steps between consecutive tokens: 1 is a token every step."""
        return [b - a for a, b in zip(self.token_steps, self.token_steps[1:])]

    @property
    def gap_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_s, self.token_s[1:])]
