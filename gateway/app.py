"""The ASGI app: OpenAI's completions, chat completions and models
endpoints over kiviq's queue, plus ``/health`` and ``/ready``.

Every request becomes one kiviq job through ``AsyncClient`` (the same
validation, backpressure and job data as ``Client.submit``). A streamed
response follows the job's event stream (replay log + pub/sub: nothing lost
or repeated); a client that goes away before the job ended cancels it, so the
worker frees its KV memory at its next step. Errors are OpenAI-shaped; no
traceback, key or Redis password ever reaches a client or the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import anyio
from redis.exceptions import AuthenticationError, RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kiviq.client.async_client import AsyncClient, AsyncJobHandle
from kiviq.client.bulk_format import CHAT_URL, COMPLETIONS_URL, DEFAULT_MODEL
from kiviq.client.errors import QueueFull
from kiviq.client.streaming import JobFailed, TextDeltas
from kiviq.client.top import read_worker_stats
from kiviq.gateway.batches import BatchStore
from kiviq.gateway.errors import APIError, error_body
from kiviq.gateway.records import ORDERS
from kiviq.gateway.responses import ChunkWriter, response_body
from kiviq.gateway.schemas import parse_request
from kiviq.jobs.models import EventType, GenerateRequest, TokenLogprob
from kiviq.jobs.settings import redact_url

log = logging.getLogger("kiviq.gateway")

MAX_BODY_BYTES = 10 * 1024 * 1024
MAX_FILE_BYTES = 200 * 1024 * 1024  # a Batch API input file
RETRY_AFTER_S = 2  # Retry-After of a 429 (queue full)
MODELS_TTL_S = 5.0  # how long the served-model list is cached
DISCONNECT_POLL_S = 0.5  # non-streamed requests: how often to look for a client that went away
OPEN_PATHS = ("/health", "/ready")  # probes need no key
# Open streams share one pub/sub connection; a command (a submit, a stream's log
# read) takes one of the pool's for its call, and past the limit waits up to
# POOL_WAIT_S for one, then the request gets a 503.
REDIS_MAX_CONNECTIONS = 2048
POOL_WAIT_S = 30.0
# The most a list answers at once (OpenAI's limits: GET /v1/files 10,000, its
# default; GET /v1/batches 100, default 20).
FILES_PAGE_LIMIT = 10_000
BATCHES_PAGE_LIMIT = 100


class Gateway:
    """The app's state: the queue client and settings."""

    def __init__(self, redis_url: str, api_keys: Iterable[str] = (), *, max_body_bytes: int = MAX_BODY_BYTES,
                 request_timeout_s: float = 600.0, files_dir: str | None = None,
                 max_file_bytes: int = MAX_FILE_BYTES, batch_max_in_flight: int = 64,
                 redis_max_connections: int = REDIS_MAX_CONNECTIONS):
        self.redis_max_connections = redis_max_connections
        self.redis_url = redis_url
        self.batches = BatchStore(files_dir, redis_url, max_in_flight=batch_max_in_flight) if files_dir else None
        self.max_file_bytes = max_file_bytes
        self.api_keys = [k.encode() for k in api_keys]
        self.max_body_bytes = max_body_bytes
        self.request_timeout_s = request_timeout_s
        self.client: AsyncClient | None = None
        self._models: tuple[float, list[str]] = (0.0, [])

    # ---- plumbing -------------------------------------------------------

    def authorized(self, request: Request) -> bool:
        if not self.api_keys or request.url.path in OPEN_PATHS:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        ok = False
        for key in self.api_keys:  # compare with every key: no timing hint of which matched
            ok |= hmac.compare_digest(given, key)
        return scheme.lower() == "bearer" and ok

    async def read_json(self, request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise APIError(413, f"the request body is larger than {self.max_body_bytes} bytes",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise APIError(413, f"the request body is larger than {self.max_body_bytes} bytes",
                               code="request_too_large")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except ValueError as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None

    async def served_models(self) -> list[str]:
        """The models the live workers serve (their stats snapshots), cached briefly."""
        at, models = self._models
        if time.monotonic() - at < MODELS_TTL_S:
            return models
        stats = await asyncio.to_thread(read_worker_stats, self.client.sync.redis)
        models = sorted({s["model"] for s in stats.values() if isinstance(s.get("model"), str)})
        self._models = (time.monotonic(), models)
        return models

    async def submit(self, job_request: GenerateRequest) -> AsyncJobHandle:
        try:
            return await self.client.enqueue(job_request)
        except QueueFull as e:
            raise APIError(429, f"the queue is full: {e}", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    async def cancel(self, job_id: str) -> None:
        """Cancel a job whose client went away (never raises: the client is gone)."""
        with anyio.CancelScope(shield=True):
            try:
                if await self.client.cancel(job_id):
                    log.info("client went away: cancelled job %s", job_id)
            except Exception as e:  # noqa: BLE001
                log.warning("could not cancel job %s: %s", job_id, type(e).__name__)

    # ---- endpoints ------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        from rq import Worker

        workers = await asyncio.to_thread(Worker.count, connection=self.client.sync.redis)
        if not workers:
            raise APIError(503, "no kiviq worker is registered", code="no_worker")
        return JSONResponse({"status": "ready", "workers": workers})

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_model_object(m) for m in await self.served_models()]})

    async def get_model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id not in await self.served_models():
            raise APIError(404, f"the model {model_id!r} does not exist (no worker serves it)", param="model",
                           code="model_not_found")
        return JSONResponse(_model_object(model_id))

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, CHAT_URL)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, COMPLETIONS_URL)

    async def _complete(self, request: Request, url: str) -> Response:
        parsed, job_request = parse_request(url, await self.read_json(request))
        model = parsed.model or next(iter(await self.served_models()), DEFAULT_MODEL)
        handle = await self.submit(job_request)
        created = int(time.time())
        if parsed.stream:
            include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
            chat = url == CHAT_URL
            writer = ChunkWriter(chat, ("chatcmpl-" if chat else "cmpl-") + handle.job_id, model, created,
                                 include_usage)
            return JobStream(self, handle, writer)
        result_task = asyncio.ensure_future(handle.result(timeout=self.request_timeout_s))
        try:
            while True:
                done, _ = await asyncio.wait({result_task}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if await request.is_disconnected():
                    result_task.cancel()
                    await self.cancel(handle.job_id)
                    return Response(status_code=499)
            result = result_task.result()
        except TimeoutError:
            await self.cancel(handle.job_id)
            raise APIError(504, f"no result within {self.request_timeout_s:g} s (is a worker running?); "
                                "the job was cancelled", code="timeout") from None
        except JobFailed as e:
            raise APIError(500, f"generation failed: {e}", code="generation_failed") from None
        finally:
            if not result_task.done():
                result_task.cancel()
        return JSONResponse(response_body(job_request, result, model, created))


    # ---- Batch API --------------------------------------------------------

    def _store(self) -> BatchStore:
        if self.batches is None:
            raise APIError(404, "the Batch API is off on this gateway (kiviq serve --files-dir DIR turns it on)",
                           code="not_found")
        return self.batches

    async def upload_file(self, request: Request) -> Response:
        store = self._store()
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_file_bytes + 64 * 1024:
            raise APIError(413, f"the file is larger than {self.max_file_bytes} bytes", code="request_too_large")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise APIError(400, "upload a file as multipart/form-data with the fields 'file' and 'purpose'")
        try:
            form = await request.form(max_files=1, max_fields=8)
        except Exception as e:  # noqa: BLE001 - a malformed form is the client's error
            raise APIError(400, f"the multipart body cannot be read: {getattr(e, 'detail', None) or e}") from None
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise APIError(400, f"purpose: only 'batch' is supported, got {purpose!r}", param="purpose",
                               code="invalid_value")
            if upload is None or isinstance(upload, str):
                raise APIError(400, "file: required (a file part)", param="file", code="invalid_value")
            content = await upload.read(self.max_file_bytes + 1)
            if len(content) > self.max_file_bytes:
                raise APIError(413, f"the file is larger than {self.max_file_bytes} bytes", code="request_too_large")
            filename = upload.filename or "input.jsonl"
        finally:
            await form.close()
        return JSONResponse(await asyncio.to_thread(store.add_file, content, filename, "batch"))

    async def get_file(self, request: Request) -> Response:
        return JSONResponse(await asyncio.to_thread(self._store().get_file, request.path_params["file_id"]))

    async def list_files(self, request: Request) -> Response:
        store = self._store()
        order = request.query_params.get("order", "desc")
        if order not in ORDERS:
            raise APIError(400, f"order: must be 'asc' or 'desc', got {order!r}", param="order",
                           code="invalid_value")
        return JSONResponse(await asyncio.to_thread(
            store.list_files, request.query_params.get("purpose"), _limit(request, FILES_PAGE_LIMIT),
            request.query_params.get("after"), order))

    async def delete_file(self, request: Request) -> Response:
        return JSONResponse(await asyncio.to_thread(self._store().delete_file, request.path_params["file_id"]))

    async def file_content(self, request: Request) -> Response:
        path = await asyncio.to_thread(self._store().file_content_path, request.path_params["file_id"])
        return FileResponse(path, media_type="application/jsonl")

    async def create_batch(self, request: Request) -> Response:
        store = self._store()
        body = await self.read_json(request)
        return JSONResponse(await asyncio.to_thread(store.create_batch, body))

    async def get_batch(self, request: Request) -> Response:
        return JSONResponse(await asyncio.to_thread(self._store().get_batch, request.path_params["batch_id"]))

    async def list_batches(self, request: Request) -> Response:
        store = self._store()
        limit = _limit(request, BATCHES_PAGE_LIMIT, default=20)
        return JSONResponse(await asyncio.to_thread(store.list_batches, limit, request.query_params.get("after")))

    async def cancel_batch(self, request: Request) -> Response:
        return JSONResponse(await asyncio.to_thread(self._store().cancel_batch, request.path_params["batch_id"]))


def _limit(request: Request, maximum: int, default: int | None = None) -> int:
    """A list's ``limit`` query parameter, 1..maximum (absent: ``default``, else ``maximum``)."""
    raw = request.query_params.get("limit")
    if raw is None:
        return maximum if default is None else default
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= maximum:
        raise APIError(400, f"limit: must be an integer 1..{maximum}, got {raw!r}", param="limit",
                       code="invalid_value")
    return limit


def _model_object(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "kiviq"}


class JobStream(StreamingResponse):
    """Server-sent events of one job; when the response ends before the job
    did (the client went away, or the server is stopping), the job is cancelled."""

    def __init__(self, gateway: Gateway, handle: AsyncJobHandle, writer: ChunkWriter):
        self.gateway, self.handle, self.writer = gateway, handle, writer
        self.finished = False
        super().__init__(self._chunks(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.finished:
                await self.gateway.cancel(self.handle.job_id)

    async def _chunks(self) -> AsyncIterator[str]:
        first = self.writer.first()
        if first:
            yield first
        deltas, pending = TextDeltas(), []
        events = self.handle.events(timeout=self.gateway.request_timeout_s)
        try:
            async for event in events:
                if event.type == EventType.restarted:
                    pending = []
                elif event.type == EventType.token and event.logprobs:
                    pending.extend(event.logprobs)
                try:
                    text = deltas.feed(event)
                except JobFailed as e:
                    self.finished = True
                    yield ChunkWriter.error(error_body(500, f"generation failed: {e}", code="generation_failed"))
                    return
                if text:
                    yield self.writer.delta(text, _take(pending))
                if event.type == EventType.done and event.result is not None:
                    self.finished = True
                    yield self.writer.end(event.result)
                    return
        except TimeoutError:
            yield ChunkWriter.error(error_body(504, f"no result within {self.gateway.request_timeout_s:g} s; "
                                                    "the job was cancelled", code="timeout"))
        except RedisError as e:
            log.warning("stream of job %s: Redis error %s", self.handle.job_id, type(e).__name__)
            yield ChunkWriter.error(error_body(503, "Redis is unreachable", code="redis_unavailable"))
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()


def _take(pending: list[TokenLogprob]) -> list[TokenLogprob] | None:
    out = list(pending) or None
    pending.clear()
    return out


def guarded(gateway: Gateway, endpoint: Callable[[Request], Awaitable[Response]]):
    """An endpoint whose every failure is an OpenAI-shaped answer (no traceback)."""

    @functools.wraps(endpoint)
    async def run(request: Request) -> Response:
        try:
            if not gateway.authorized(request):
                raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                               code="invalid_api_key")
            return await endpoint(request)
        except APIError as e:
            return e.response()
        except AuthenticationError:
            log.error("Redis at %s refused the gateway's credentials", redact_url(gateway.redis_url))
            return APIError(503, "the gateway cannot use its Redis", code="redis_unavailable").response()
        except RedisError as e:
            log.error("Redis at %s: %s", redact_url(gateway.redis_url), type(e).__name__)
            return APIError(503, "Redis is unreachable; retry later", code="redis_unavailable").response()
        except Exception:  # noqa: BLE001 - logged here, never sent to the client
            log.exception("internal error on %s %s", request.method, request.url.path)
            return APIError(500, "internal error", code="internal_error").response()

    return run


async def _http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    if status == 404:
        message = f"unknown route {request.method} {request.url.path}"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = getattr(exc, "detail", None) or "error"
    return JSONResponse(error_body(status, message, code="not_found" if status == 404 else None),
                        status_code=status, headers=getattr(exc, "headers", None))


def create_app(redis_url: str, api_keys: Iterable[str] = (), **options: Any) -> Starlette:
    """The gateway's ASGI app over the Redis at ``redis_url``.

    Args:
        api_keys: accepted Bearer keys; none: no authentication.
        **options: ``max_body_bytes``, ``request_timeout_s``, ``files_dir`` (the
            Batch API's directory; None: the Batch API is off), ``max_file_bytes``,
            ``batch_max_in_flight``, ``redis_max_connections`` (see ``Gateway``).
    """
    gateway = Gateway(redis_url, api_keys, **options)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        gateway.client = AsyncClient(redis_url, max_connections=gateway.redis_max_connections,
                                     pool_timeout=POOL_WAIT_S)
        if gateway.batches is not None:
            resumed = await asyncio.to_thread(gateway.batches.resume)
            if resumed:
                log.info("resumed %d unfinished batch(es): %s", len(resumed), ", ".join(resumed))
        try:
            yield
        finally:
            await gateway.client.aclose()  # closes both of its pools

    def route(path: str, endpoint, methods: list[str]) -> Route:
        return Route(path, guarded(gateway, endpoint), methods=methods)

    routes = [
        route("/health", gateway.health, ["GET"]),
        route("/ready", gateway.ready, ["GET"]),
        route("/v1/models", gateway.list_models, ["GET"]),
        route("/v1/models/{model_id:path}", gateway.get_model, ["GET"]),
        route("/v1/chat/completions", gateway.chat_completions, ["POST"]),
        route("/v1/completions", gateway.completions, ["POST"]),
        route("/v1/files", gateway.upload_file, ["POST"]),
        route("/v1/files", gateway.list_files, ["GET"]),
        route("/v1/files/{file_id}", gateway.get_file, ["GET"]),
        route("/v1/files/{file_id}", gateway.delete_file, ["DELETE"]),
        route("/v1/files/{file_id}/content", gateway.file_content, ["GET"]),
        route("/v1/batches", gateway.create_batch, ["POST"]),
        route("/v1/batches", gateway.list_batches, ["GET"]),
        route("/v1/batches/{batch_id}", gateway.get_batch, ["GET"]),
        route("/v1/batches/{batch_id}/cancel", gateway.cancel_batch, ["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    app.state.gateway = gateway
    return app
