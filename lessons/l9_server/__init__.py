"""L9: serving. An OpenAI-compatible HTTP server over L8's engine: streaming, abort, backpressure."""
from lessons.l9_server.engine import L9Engine

# What scripts/lesson_diff.py compares with earlier lessons: role -> where this lesson defines it.
ROLES = {
    'server loop': 'engine_loop.py::EngineLoop._run',
    'abort': 'engine.py::L9Engine.abort',
    'output': 'engine_loop.py::EngineLoop._emit',
}

__all__ = ["L9Engine"]
