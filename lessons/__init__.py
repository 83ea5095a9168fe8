"""One package per lesson; each holds only what its lesson changes."""
