"""``kiviq serve``: run the OpenAI-compatible gateway with uvicorn.

A bad flag or a missing extra is one ``kiviq serve: error: ...`` line and
exit status 2 (no traceback)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from urllib.parse import urlsplit

from kiviq.jobs.cli_help import HelpFormatter
from kiviq.jobs.settings import DEFAULT_REDIS_URL, redact_url, redis_url_from_env

REDIS_URL_SCHEMES = ("redis", "rediss", "unix")
log = logging.getLogger("kiviq.gateway")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """A bad flag: one line, no usage block (``--help`` shows it)."""
        print(f"{self.prog}: error: {message} (kiviq serve --help lists the flags)", file=sys.stderr, flush=True)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kiviq serve", formatter_class=HelpFormatter,
        description="Serve an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, "
                    "/v1/files, /v1/batches, /health, /ready) that enqueues into kiviq's Redis queues. Needs pip install 'kiviq[http]'.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--redis-url", default=None, help=f"Redis to use (default: $REDIS_URL or {DEFAULT_REDIS_URL})")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="accept this Bearer key (repeatable; also $KIVIQ_API_KEYS, comma-separated); "
                        "default: none, no authentication")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may wait for its job before it is cancelled (504)")
    p.add_argument("--max-body-mb", type=float, default=10.0, help="largest request body accepted (413 above)")
    p.add_argument("--files-dir", default=None, metavar="DIR",
                   help="where the Batch API keeps its files and batches (default: $KIVIQ_CACHE_DIR/gateway, "
                        "else ~/.cache/kiviq/gateway)")
    p.add_argument("--no-batches", action="store_true", help="turn the Batch API (/v1/files, /v1/batches) off")
    p.add_argument("--max-file-mb", type=float, default=200.0, help="largest Batch API file accepted")
    p.add_argument("--batch-max-in-flight", type=int, default=64,
                   help="most jobs each batch keeps queued or running at once")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log level")
    p.add_argument("--debug", action="store_true", default=os.environ.get("KIVIQ_DEBUG") == "1",
                   help="on a start-up error, print the traceback too (default: off, on with KIVIQ_DEBUG=1)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # a bad flag: argparse's one usage line + error, exit 2

    def fail(message: str) -> int:
        print(f"kiviq serve: error: {message}", file=sys.stderr, flush=True)
        return 2

    url = redis_url_from_env(args.redis_url)
    if urlsplit(url).scheme not in REDIS_URL_SCHEMES:
        return fail(f"--redis-url {redact_url(url)!r}: the URL must start with redis://, rediss:// or unix://")
    if not 0 < args.port < 65536:
        return fail(f"--port {args.port}: must be 1..65535")
    if args.request_timeout <= 0 or args.max_body_mb <= 0 or args.max_file_mb <= 0:
        return fail("--request-timeout, --max-body-mb and --max-file-mb must be > 0")
    if args.batch_max_in_flight < 1:
        return fail(f"--batch-max-in-flight {args.batch_max_in_flight}: must be >= 1")
    files_dir = None
    if not args.no_batches:
        files_dir = args.files_dir or os.path.join(
            os.environ.get("KIVIQ_CACHE_DIR") or os.path.expanduser("~/.cache/kiviq"), "gateway")
        try:
            os.makedirs(files_dir, exist_ok=True)
        except OSError as e:
            return fail(f"--files-dir {files_dir}: {e.strerror}")
    keys = list(args.api_key or [])
    keys += [k.strip() for k in os.environ.get("KIVIQ_API_KEYS", "").split(",") if k.strip()]
    if any(not k for k in keys):
        return fail("--api-key: a key must not be empty")
    try:
        import uvicorn

        from kiviq.gateway.app import create_app
    except ImportError as e:
        return fail(f"{e.name or e} is not installed; pip install 'kiviq[http]'")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(url, keys, max_body_bytes=int(args.max_body_mb * 1024 * 1024),
                     request_timeout_s=args.request_timeout, files_dir=files_dir,
                     max_file_bytes=int(args.max_file_mb * 1024 * 1024), batch_max_in_flight=args.batch_max_in_flight)
    log.info("kiviq gateway on http://%s:%d, Redis %s, %s, Batch API %s", args.host, args.port, redact_url(url),
             f"{len(keys)} API key(s)" if keys else "no API key (anyone who can connect may use it)",
             f"files in {files_dir}" if files_dir else "off")
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    except KeyboardInterrupt:
        return 130
    except (OSError, SystemExit) as e:
        if isinstance(e, SystemExit):  # uvicorn exits 1 after logging why (e.g. the port is taken)
            return 0 if not e.code else 1
        if args.debug:
            traceback.print_exc()
        print(f"kiviq serve: error: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0
