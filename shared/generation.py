"""Rules every engine shares: when a request stops, and whether it fits the model's context."""
from __future__ import annotations

from dataclasses import dataclass

from shared.config import Qwen3Config
from shared.errors import CourseError


@dataclass(frozen=True)
class StopRule:
    """Stop after `max_new_tokens`, or at the first EOS id (which is kept as the last output token)."""

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise CourseError(f"max-new-tokens must be at least 1, got {self.max_new_tokens}")

    def is_done(self, generated: list[int]) -> bool:
        if len(generated) >= self.max_new_tokens:
            return True
        return not self.ignore_eos and bool(generated) and generated[-1] in self.eos_token_ids


def check_prompt(prompt_ids: list[int], stop: StopRule, cfg: Qwen3Config) -> None:
    """A request must fit the model's positions: prompt + new tokens <= max_position_embeddings."""
    if not prompt_ids:
        raise CourseError("empty prompt: it encodes to no tokens")
    total = len(prompt_ids) + stop.max_new_tokens
    if total > cfg.max_position_embeddings:
        raise CourseError(
            f"prompt ({len(prompt_ids)} tokens) + max-new-tokens ({stop.max_new_tokens}) = {total} exceeds "
            f"the model's context of {cfg.max_position_embeddings}"
        )
