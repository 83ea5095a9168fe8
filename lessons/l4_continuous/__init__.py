"""L4: continuous batching. A scheduler admits and retires requests every step; per-request sampling."""
from lessons.l4_continuous.engine import Arrival, L4Engine
from lessons.l4_continuous.sampling import SamplingParams

__all__ = ["Arrival", "L4Engine", "SamplingParams"]
