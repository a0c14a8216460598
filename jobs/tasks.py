"""The rq task path that kiviq jobs carry.

A kiviq worker never calls this: it pulls jobs off the queue and runs them
through its batching engine. The function exists so that a plain ``rq worker``
started on a kiviq queue by mistake fails each job with a clear message rather
than an import error.
"""


def generate(request: dict) -> None:
    """Refuse to run outside a kiviq worker."""
    raise RuntimeError(
        "kiviq generation jobs must be run by `kiviq worker`, not a plain rq worker"
    )
