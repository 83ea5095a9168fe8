"""Which drafts the target keeps: the acceptance rules, one row of logits per draft position plus one.

`logits` [k+1, V] are the target's rows for positions n .. n+k; `drafts` are d1 .. dk. The result is the
tokens to append: the accepted drafts, then one token of the target's own (the correction at the first
rejection, or the bonus after k accepted), so always between 1 and k+1 tokens.

A deterministic drafter (n-gram, a greedy draft model, the test replay) proposes d with q = one-hot(d).
The standard rule (accept with probability min(1, p(d)/q(d)) = p(d); on rejection sample from
normalise(max(0, p - q)), which is p with d removed) is then the same law as: sample x from p as the
engine always does, with the request's own generator, and keep the draft when x == d. That form is what
`accept_one_hot` does, for greedy (x = argmax) and sampled rows alike. It draws one uniform per token
emitted, exactly as decoding without drafts does, so a seeded request gives the same tokens with and
without speculation. A drafter that samples its drafts from a distribution q needs the general rule
(`accept_sampled`): exact in distribution, but it draws its own numbers, so the tokens differ.
"""
from __future__ import annotations

import torch

from lessons.l4_continuous.sampling import SamplingParams, filtered_probs, pick, sample_row


# Task L11.2: verify certain drafts: keep d(j+1) while row j's token equals it, then the target's own
def accept_one_hot(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                   generator: torch.Generator | None) -> list[int]:
    """Drafts proposed with certainty: keep d(j+1) while the target's own token for row j equals it."""
    if params.greedy:  # one argmax over all rows: no random numbers, nothing to stop early for
        return keep_while_equal(drafts, logits.argmax(dim=-1).tolist())
    out = []
    for j in range(len(drafts) + 1):
        token = sample_row(logits[j], params, generator)  # one uniform per emitted token, as without drafts
        out.append(token)
        if j == len(drafts) or token != drafts[j]:
            return out
    return out


# Task L11.2: verify certain drafts: keep d(j+1) while row j's token equals it, then the target's own
def keep_while_equal(drafts: list[int], targets: list[int]) -> list[int]:
    """The greedy rule on the target's k+1 choices: its tokens up to and including the first that is not the
    draft in its place (all k+1 when every draft matched)."""
    for j, draft in enumerate(drafts):
        if targets[j] != draft:
            return targets[:j + 1]
    return targets[:len(drafts) + 1]


# Task L11.3: drafts sampled from q [k, V]: accept d with min(1, p(d)/q(d)), else sample normalise(max(0, p - q))
def accept_sampled(logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator) -> list[int]:
    """Drafts sampled from q (`draft_probs` [k, V], each row summing to 1): Leviathan et al.'s rule. Accept d
    with probability min(1, p(d) / q(d)); on rejection sample from normalise(max(0, p - q)). The emitted
    token's law is p, whatever q is."""
    out = []
    for j, draft in enumerate(drafts):
        p = target_probs(logits[j], params)
        q = draft_probs[j].to(p.device, torch.float32)
        u = float(torch.rand(1, generator=generator, device=generator.device))
        if q[draft] > 0 and u < min(1.0, float(p[draft] / q[draft])):
            out.append(draft)
            continue
        residual = (p - q).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q: a rejection has probability 0; rounding can still land here
            residual = p
        ids = residual.nonzero().flatten()
        u = torch.rand(1, generator=generator, device=generator.device)
        out.append(pick(residual[ids], ids, u))
        return out
    p = target_probs(logits[len(drafts)], params)
    ids = p.nonzero().flatten()
    return out + [pick(p[ids], ids, torch.rand(1, generator=generator, device=generator.device))]


def target_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target's distribution over the whole vocabulary after temperature, top-k and top-p (L4's warpers)."""
    if params.greedy:
        p = torch.zeros_like(row, dtype=torch.float32)
        p[int(row.argmax())] = 1.0
        return p
    probs, ids = filtered_probs(row, params)
    p = torch.zeros_like(row, dtype=torch.float32)
    p[ids] = probs
    return p
