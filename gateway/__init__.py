"""kiviq's OpenAI-compatible HTTP gateway (``kiviq serve``): an ASGI app
(Starlette, served by uvicorn) that is a client of the queue. It imports
``kiviq.client`` and ``kiviq.jobs`` only, so any number of gateways can
front the same Redis; nothing else in kiviq imports it.

Install with ``pip install 'kiviq[http]'``.
"""
