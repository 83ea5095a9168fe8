"""The server's side of structured output: take the fields from the body, compile off the event loop, count.

A request's path (L9's, plus two stops): its structured-output fields are taken out before L9's parser sees
the body (protocol.py); after the cheap refusals (model name, a full queue), the grammar is compiled in a
worker thread, or found in the cache, within a deadline; the request's sampling parameters then carry it to
the engine. A grammar that does not compile is a 400 naming llguidance's reason; the engine never sees it.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import fields, replace

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.concurrency import run_in_threadpool
from tokenizers import Tokenizer

from lessons.l4_continuous.sampling import SamplingParams
from lessons.l9_server.metrics import PREFIX
from lessons.l9_server.protocol import ApiError, GenerationRequest
from lessons.l13_structured.grammar import KINDS, Grammar, GrammarCompiler, GrammarSpec
from lessons.l13_structured.protocol import take_spec
from lessons.l13_structured.sampling import ConstrainedSampling
from shared.errors import CourseError

COMPILE_TIMEOUT_S = 30.0  # a schema that takes longer is refused; llguidance's own limits usually stop it first
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class StructuredMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter(PREFIX + "structured_requests", "Requests with a grammar, by kind.", ["kind"],
                                registry=registry)
        self.compile_seconds = Histogram(PREFIX + "grammar_compile_seconds", "Compiling a grammar not in the cache "
                                         "(the tokenizer's one-time load included in the first).",
                                         buckets=COMPILE_BUCKETS, registry=registry)
        self.cache_hits = Counter(PREFIX + "grammar_cache_hits", "Grammars found compiled in the cache.",
                                  registry=registry)
        self.failures = Counter(PREFIX + "grammar_compile_failures", "Grammars refused (400) because they did not "
                                "compile.", registry=registry)
        for kind in KINDS:
            self.requests.labels(kind)  # every kind shows 0 before its first request


class StructuredOutputs:
    """One per server: the compiler (its tokenizer loaded at the first grammar: a server that never sees one
    never pays the 1.4 s) and the metrics."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: frozenset[int], registry: CollectorRegistry):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self.metrics = StructuredMetrics(registry)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    take = staticmethod(take_spec)

    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
            return self._compiler

    def compile(self, spec: GrammarSpec) -> Grammar:
        """In a worker thread: the compiled grammar, timed when it was not cached."""
        start = time.perf_counter()
        grammar, cached = self.compiler().lookup(spec)
        if cached:
            self.metrics.cache_hits.inc()
        else:
            self.metrics.compile_seconds.observe(time.perf_counter() - start)
        return grammar

    async def constrain(self, req: GenerationRequest, spec: GrammarSpec) -> GenerationRequest:
        """The request with its grammar in its sampling parameters; a grammar that does not compile is a 400."""
        param = spec.origin or None
        try:
            grammar = await asyncio.wait_for(run_in_threadpool(self.compile, spec), COMPILE_TIMEOUT_S)
        except CourseError as e:
            self.metrics.failures.inc()
            raise ApiError(400, str(e), param) from None
        except asyncio.TimeoutError:
            self.metrics.failures.inc()
            raise ApiError(400, f"the {spec.kind} took more than {COMPILE_TIMEOUT_S:g} s to compile", param) from None
        self.metrics.requests.labels(spec.kind).inc()
        values = {f.name: getattr(req.sampling, f.name) for f in fields(SamplingParams)}
        return replace(req, sampling=ConstrainedSampling(**values, grammar=grammar))
