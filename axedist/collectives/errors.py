"""Errors raised by axedist's communication layer."""


class CollectiveError(RuntimeError):
    """Base class of axedist communication errors."""


class CollectiveTimeoutError(CollectiveError):
    """A kernel's spin-wait gave up: a peer never signalled the flag (peer crashed, diverged
    call sequence, or a rank that skipped the call). The message names the peer and the flag."""


class SymmetricMemoryUnavailable(CollectiveError):
    """Symmetric memory (or NVLink peer access between the group's GPUs) is not available."""
