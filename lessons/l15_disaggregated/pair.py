"""A prefill engine and a decode engine in one process, joined by the real page transfer on a loopback socket: what
the smoke and the tests drive. The servers (scripts/serve.py --kv-role, and the proxy) make the same calls in three
processes, with HTTP between them instead of a function call."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lessons.l4_continuous.sampling import SamplingParams
from lessons.l14_batch_invariant.record import LogitsRecord, Recorded
from lessons.l15_disaggregated.connector import LoadResult
from lessons.l15_disaggregated.engine import L15Engine
from shared.generation import StopRule


@dataclass
class Disaggregated(Recorded):
    loads: list[LoadResult]


# Task L15.7: the flow: P prefills (one token) and leases; D pulls what it lacks, then decodes as after a cache hit
def prefill_remote(prefill: L15Engine, prompts: Sequence[list[int]], stop: StopRule) -> list[dict]:
    """P's part: each prompt prefilled with one output token (vLLM's proxy asks P for max_tokens 1), its blocks
    leased as the request finishes; the kv_transfer_params of each, in order."""
    one = StopRule(1, stop.eos_token_ids, stop.ignore_eos)
    seqs = [prefill.add_request(list(p), one) for p in prompts]
    params: dict[int, dict] = {}
    while prefill.scheduler.has_work():
        for seq in prefill.step():  # finished now: lease before the next step can evict anything
            params[seq.seq_id] = prefill.request_finished(seq)
    return [params[s.seq_id] for s in seqs]


def run_disaggregated(prefill: L15Engine, decode: L15Engine, prompts: Sequence[list[int]], stop: StopRule, *,
                      sampling: Callable[[int], SamplingParams] = lambda i: SamplingParams(),
                      n: Callable[[int], int] = lambda i: 1) -> Disaggregated:
    """Every prompt through P then D, all at once on each; D's logits recorded as L14's run_recorded records them."""
    params = prefill_remote(prefill, prompts, stop)
    record = LogitsRecord(decode)
    seqs, loads = [], []
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        group, loaded = decode.add_remote(list(ids), stop, p, sampling(i), n(i))
        seqs += group
        loads.append(loaded)
    while decode.scheduler.has_work():
        decode.step()
    prefill.step()  # P frees what D released (its engine thread does it between steps)
    return Disaggregated([s.output_ids for s in seqs], [record.of(s) for s in seqs], decode, loads)
