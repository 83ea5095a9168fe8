"""The one exception type for bad input: scripts turn it into a one-line message and exit status 2."""


class CourseError(Exception):
    """Input the course cannot run: a bad path, option, prompt or a request that cannot fit."""


class PoolExhausted(CourseError):
    """The block pool has fewer free blocks than a request asked for. Raised before anything changes."""

    def __init__(self, needed: int, free: int, total: int):
        super().__init__(f"KV pool exhausted: need {needed} block(s), {free} of {total} free")
        self.needed, self.free, self.total = needed, free, total


class RunFailure(Exception):
    """The run broke, not its input (a tensor-parallel rank exited or hung): one line, exit status 1."""
