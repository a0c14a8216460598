"""Errors the client raises that its modules share."""

from __future__ import annotations


class QueueFull(RuntimeError):
    """The queues hold as many jobs as the operator allows; nothing was enqueued."""
