"""What speculation did: drafts proposed and kept, per position, and the target forwards it saved."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    verify_rows: int = 0  # decode rows that carried at least one draft
    plain_rows: int = 0  # decode rows without drafts (budget, blocks, max tokens, or no guess)
    drafted: int = 0  # draft tokens proposed and verified
    # Counted as verification decided, before a stop cuts the output (as vLLM counts): they measure the drafter.
    accepted: int = 0  # of those, equal to the target's own choice
    emitted: int = 0  # tokens decode rows produced (accepted drafts + one of the target's own per row)
    accepted_at: list[int] = field(default_factory=list)  # [j]: proposals whose draft j+1 was accepted

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        if drafted:
            self.verify_rows += 1
        else:
            self.plain_rows += 1
        self.drafted, self.accepted, self.emitted = self.drafted + drafted, self.accepted + accepted, self.emitted + emitted
        self.accepted_at += [0] * (accepted - len(self.accepted_at))
        for j in range(accepted):
            self.accepted_at[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify row (vLLM's "mean acceptance length"): 1 + accepted drafts per proposal."""
        return 1 + self.accepted / self.verify_rows if self.verify_rows else 0.0

    def line(self) -> str:
        return (f"{self.drafted} drafted, {self.accepted} accepted ({self.acceptance_rate:.0%}), mean accepted "
                f"length {self.mean_accepted_length:.2f} over {self.verify_rows} verify row(s) "
                f"(+{self.plain_rows} plain decode row(s))")
