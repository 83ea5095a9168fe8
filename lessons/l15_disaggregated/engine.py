"""L15's engine: L14's, in one of vLLM's three KV roles.

  kv_both      colocated: L14's engine exactly (prefill and decode in one pool)
  kv_producer  the prefill engine P: runs each request's prompt (and its first token), then leases the prompt's
               full blocks to a decode engine until it pulls them (connector.PrefillConnector)
  kv_consumer  the decode engine D: before admitting a request prefilled elsewhere, pulls the blocks its prefix
               cache lacks from P (connector.DecodeConnector); then decodes it like any request that hit the cache

The split is two engines, each L14's; what joins them is the prefix cache. D files pulled blocks where its own
prefills would have put them, so the request's admission is an ordinary hit, and every lesson since L6 works
unchanged on D: n > 1 forks from the hit, seeded sampling starts its generator on D, int8 pages move with their
scales, and with L14's mode on both engines D's logits are bitwise a colocated engine's.
"""
from __future__ import annotations

from lessons.l2_token_flat.engine import blocks_for
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l6_prefix_sharing.sequence import SharedSequence
from lessons.l14_batch_invariant import L14Engine
from lessons.l15_disaggregated.connector import DecodeConnector, LoadResult, PrefillConnector
from shared.errors import CourseError
from shared.generation import StopRule

KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


class L15Engine(L14Engine):
    def __init__(self, *args, kv_role: str = "kv_both", connector_args: dict | None = None, **kwargs):
        if kv_role not in KV_ROLES:
            raise CourseError(f"unknown kv_role {kv_role!r}: use one of {', '.join(KV_ROLES)}")
        super().__init__(*args, **kwargs)
        self.kv_role = kv_role
        self.producer = PrefillConnector(self, **(connector_args or {})) if kv_role == "kv_producer" else None
        self.consumer = DecodeConnector(self, **(connector_args or {})) if kv_role == "kv_consumer" else None

    def step(self) -> list[SharedSequence]:
        if self.producer is not None:
            self.producer.reap()  # the allocator is this thread's: released and expired leases are freed here
        return super().step()

    def request_finished(self, seq: SharedSequence) -> dict:
        """P: the kv_transfer_params for a request whose prefill is done (call it before the next step)."""
        if self.producer is None:
            raise CourseError("request_finished is the prefill engine's (kv_role kv_producer)")
        return self.producer.request_finished(seq.prompt_ids)

    # Task L15.7: the flow: P prefills (one token) and leases; D pulls what it lacks, then decodes as after a cache hit
    def add_remote(self, prompt_ids: list[int], stop: StopRule, kv_transfer_params: dict,
                   sampling: SamplingParams = SamplingParams(), n: int = 1) -> tuple[list[SharedSequence], LoadResult]:
        """D: pull the prompt's blocks from P, then add the request (its n sequences) as add_parallel does. Bad input
        (a token outside the vocabulary, a request the whole pool could never hold) is refused before any pull."""
        if self.consumer is None:
            raise CourseError("add_remote is the decode engine's (kv_role kv_consumer)")
        self.check_request(prompt_ids, stop, sampling)  # bad input is refused before a block is taken
        need = blocks_for(len(prompt_ids) + stop.max_new_tokens, self.block_size)
        if need > self.scheduler.capacity:  # what add_parallel would refuse, refused before the pull
            raise CourseError(f"prompt ({len(prompt_ids)} tokens) + max-new-tokens ({stop.max_new_tokens}) needs "
                              f"{need} blocks of {self.block_size} tokens; the whole pool has {self.scheduler.capacity}")
        loaded = self.consumer.load(prompt_ids, kv_transfer_params)
        return self.add_parallel(prompt_ids, stop, sampling, n), loaded

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
