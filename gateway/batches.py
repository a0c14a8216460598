"""The Batch API (``/v1/files``, ``/v1/batches``) on top of ``kiviq bulk``.

Where things live: files and batch records are kept in a directory the
operator names (``kiviq serve --files-dir``), not in Redis. ``run_bulk``
works on files (it appends results to an output file and resumes from it),
batch inputs and outputs can be far larger than what belongs in Redis'
memory, and a directory survives a Redis flush. Layout::

    <dir>/files/<file id>.json      the file object (OpenAI's shape)
    <dir>/files/<file id>.jsonl     its content
    <dir>/batches/<batch id>.json   the batch object
    <dir>/batches/<batch id>.out    run_bulk's output (results and errors, one line per custom_id)

A batch runs in a thread of the gateway that created it, through
``run_bulk`` (so it is resumable and writes exactly one line per
custom_id); at the end its output is split into the batch's output file
(results) and error file (error lines). A gateway that restarts resumes the
batches it finds unfinished: ``run_bulk`` skips custom_ids already written and
re-attaches to jobs still queued or running. Several gateways may share one
directory for reading files and batches; each batch is run by the gateway
that created it (or resumed it after a restart).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from typing import Any

from kiviq.client.bulk import run_bulk
from kiviq.client.bulk_format import CHAT_URL, COMPLETIONS_URL, count_lines
from kiviq.client.client import Client
from kiviq.gateway.errors import APIError
from kiviq.gateway.records import list_object, new_id, page, read_all, read_json, safe_id, write_json

log = logging.getLogger("kiviq.gateway")

ENDPOINTS = (CHAT_URL, COMPLETIONS_URL)
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
BATCH_TTL_S = 24 * 3600  # the only completion_window, "24h": expires_at is informational


def count_records(path: str) -> tuple[int, int]:
    """(results, errors) among the complete lines of a run's output (read-only:
    the run may be appending to it)."""
    ok = failed = 0
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return 0, 0
    for raw in data.split(b"\n")[:-1]:  # the last piece is '' or a line still being written
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if isinstance(record, dict):
            if record.get("error"):
                failed += 1
            else:
                ok += 1
    return ok, failed


class BatchStore:
    """Files and batches in a directory, and the threads running batches."""

    def __init__(self, directory: str, redis_url: str, *, max_in_flight: int = 64):
        self.dir = os.path.abspath(os.path.expanduser(directory))
        self.files_dir = os.path.join(self.dir, "files")
        self.batches_dir = os.path.join(self.dir, "batches")
        os.makedirs(self.files_dir, exist_ok=True)
        os.makedirs(self.batches_dir, exist_ok=True)
        self.redis_url = redis_url
        self.max_in_flight = max_in_flight
        self._lock = threading.Lock()
        self._cancel: dict[str, threading.Event] = {}
        self._threads: dict[str, threading.Thread] = {}

    # ---- files ----------------------------------------------------------

    def _file_paths(self, file_id: str) -> tuple[str, str]:
        if not safe_id(file_id, "file"):
            raise APIError(404, f"no such file: {file_id!r}", param="file_id", code="not_found")
        return os.path.join(self.files_dir, file_id + ".json"), os.path.join(self.files_dir, file_id + ".jsonl")

    def add_file(self, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        file_id = new_id("file")
        meta_path, data_path = self._file_paths(file_id)
        with open(data_path, "wb") as f:
            f.write(content)
        obj = {"id": file_id, "object": "file", "bytes": len(content), "created_at": int(time.time()),
               "filename": filename, "purpose": purpose, "status": "processed", "status_details": None,
               "expires_at": None}
        write_json(meta_path, obj)
        return obj

    def get_file(self, file_id: str) -> dict[str, Any]:
        meta_path, _ = self._file_paths(file_id)
        obj = read_json(meta_path)
        if obj is None:
            raise APIError(404, f"no such file: {file_id!r}", param="file_id", code="not_found")
        return obj

    def file_content_path(self, file_id: str) -> str:
        self.get_file(file_id)
        return self._file_paths(file_id)[1]

    def list_files(self, purpose: str | None = None, limit: int = 10_000, after: str | None = None,
                   order: str = "desc") -> dict[str, Any]:
        """Uploaded files and batch outputs (``purpose`` keeps one kind), newest first by default."""
        files = [f for f in read_all(self.files_dir) if purpose is None or f["purpose"] == purpose]
        return list_object(*page(files, limit, after, order))

    def delete_file(self, file_id: str) -> dict[str, Any]:
        """Delete a file, unless an unfinished batch reads it: that batch would
        fail at its next resume (a gateway restart needs the input again)."""
        with self._lock:  # create_batch takes its input under the same lock
            self.get_file(file_id)
            for batch in read_all(self.batches_dir):
                if batch.get("input_file_id") == file_id and batch["status"] in UNFINISHED:
                    raise APIError(409, f"file {file_id} is the input of batch {batch['id']}, which is "
                                        f"{batch['status']}; delete the file once the batch has ended (or "
                                        "cancel the batch)", param="file_id", code="file_in_use")
            meta_path, data_path = self._file_paths(file_id)
            try:
                os.remove(meta_path)  # first: a reader never finds a file object without its content
            except FileNotFoundError:  # another gateway on this directory deleted it just now
                raise APIError(404, f"no such file: {file_id!r}", param="file_id", code="not_found") from None
            with contextlib.suppress(FileNotFoundError):
                os.remove(data_path)
        return {"id": file_id, "object": "file", "deleted": True}

    # ---- batches --------------------------------------------------------

    def _batch_path(self, batch_id: str) -> str:
        if not safe_id(batch_id, "batch"):
            raise APIError(404, f"no such batch: {batch_id!r}", param="batch_id", code="not_found")
        return os.path.join(self.batches_dir, batch_id + ".json")

    def get_batch(self, batch_id: str) -> dict[str, Any]:
        obj = read_json(self._batch_path(batch_id))
        if obj is None:
            raise APIError(404, f"no such batch: {batch_id!r}", param="batch_id", code="not_found")
        if obj["status"] in ("in_progress", "cancelling"):  # live counts from the run's output
            ok, failed = count_records(self._out_path(batch_id))
            obj["request_counts"].update(completed=ok, failed=failed)
        return obj

    def list_batches(self, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        """Newest first, as OpenAI lists them."""
        batches, has_more = page(read_all(self.batches_dir), limit, after)
        return list_object([self.get_batch(b["id"]) for b in batches], has_more)

    def create_batch(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
        if unknown:
            raise APIError(400, f"{unknown[0]}: Extra inputs are not permitted", param=unknown[0],
                           code="invalid_value")
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint: must be one of {', '.join(ENDPOINTS)}", param="endpoint",
                           code="invalid_value")
        if body.get("completion_window") != "24h":
            raise APIError(400, "completion_window: must be '24h'", param="completion_window",
                           code="invalid_value")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise APIError(400, "metadata: at most 16 string keys with string values", param="metadata",
                           code="invalid_value")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise APIError(400, "input_file_id: required (a file id)", param="input_file_id", code="invalid_value")
        with self._lock:  # the input file is not deleted between this check and the batch's record
            self._check_input_file(file_id)
            batch = self._new_batch(file_id, endpoint, metadata)
            self._save(batch)
        self._start(batch["id"])
        return batch

    def _check_input_file(self, file_id: str) -> None:
        try:
            file = self.get_file(file_id)
        except APIError:
            raise APIError(404, f"no such file: {file_id!r}", param="input_file_id", code="not_found") from None
        if file["purpose"] != "batch":
            raise APIError(400, f"input_file_id: file {file_id} has purpose {file['purpose']!r}, not 'batch'",
                           param="input_file_id", code="invalid_value")

    @staticmethod
    def _new_batch(file_id: str, endpoint: str, metadata: dict[str, str] | None) -> dict[str, Any]:
        now = int(time.time())
        return {"id": new_id("batch"), "object": "batch", "endpoint": endpoint, "errors": None,
                "input_file_id": file_id, "completion_window": "24h", "status": "validating",
                "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                "expires_at": now + BATCH_TTL_S, "finalizing_at": None, "completed_at": None, "failed_at": None,
                "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata}

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        with self._lock:
            batch = self.get_batch(batch_id)
            if batch["status"] not in ("validating", "in_progress"):
                if batch["status"] in ("cancelling", "cancelled"):
                    return batch
                raise APIError(400, f"batch {batch_id} is {batch['status']}; only a running batch can be "
                                    "cancelled", param="batch_id", code="invalid_state")
            batch.update(status="cancelling", cancelling_at=int(time.time()))
            self._save(batch)
            event = self._cancel.get(batch_id)
        if event is not None:
            event.set()
        else:  # not run here (another gateway, or never started): finish it as cancelled here
            self._start(batch_id)
        return batch

    def resume(self) -> list[str]:
        """Start every unfinished batch found in the directory (after a restart)."""
        resumed = []
        for batch in sorted(read_all(self.batches_dir), key=lambda b: b["id"]):
            if batch["status"] in UNFINISHED:
                self._start(batch["id"])
                resumed.append(batch["id"])
        return resumed

    # ---- running --------------------------------------------------------

    def _out_path(self, batch_id: str) -> str:
        return os.path.join(self.batches_dir, batch_id + ".out")

    def _save(self, batch: dict[str, Any]) -> None:
        write_json(self._batch_path(batch["id"]), batch)

    def _update(self, batch_id: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            batch = read_json(self._batch_path(batch_id))
            if batch["status"] == "cancelling" and fields.get("status") == "in_progress":
                fields.pop("status")
            batch.update(fields)
            self._save(batch)
            return batch

    def _start(self, batch_id: str) -> None:
        with self._lock:
            if batch_id in self._threads and self._threads[batch_id].is_alive():
                return
            event = self._cancel.setdefault(batch_id, threading.Event())
            thread = threading.Thread(target=self._run, args=(batch_id, event), name=f"kiviq-{batch_id}",
                                      daemon=True)
            self._threads[batch_id] = thread
        thread.start()

    def _run(self, batch_id: str, cancel: threading.Event) -> None:
        try:
            batch = read_json(self._batch_path(batch_id))
            in_path = self.file_content_path(batch["input_file_id"])
            if batch["status"] == "cancelling":
                cancel.set()
            total = count_lines(in_path)
            batch = self._update(batch_id, status="in_progress", request_counts={"total": total, "completed": 0,
                                                                                  "failed": 0},
                                 in_progress_at=batch["in_progress_at"] or int(time.time()))
            client = Client(self.redis_url)
            try:
                run_bulk(client, in_path, self._out_path(batch_id), max_in_flight=self.max_in_flight,
                         progress=False, stop=cancel.is_set)
            finally:
                client.redis.close()
            self._finish(batch_id, cancelled=cancel.is_set())
        except Exception as e:  # noqa: BLE001 - the batch fails; the gateway goes on
            log.warning("batch %s failed: %s: %s", batch_id, type(e).__name__, e)
            self._update(batch_id, status="failed", failed_at=int(time.time()),
                         errors={"object": "list", "data": [{"code": "batch_failed", "message":
                                                              f"{type(e).__name__}: {e}", "param": None,
                                                              "line": None}]})

    def _finish(self, batch_id: str, cancelled: bool) -> None:
        self._update(batch_id, finalizing_at=int(time.time()), **({} if cancelled else {"status": "finalizing"}))
        ok_lines, error_lines = [], []
        with open(self._out_path(batch_id), "rb") as f:
            for raw in f.read().split(b"\n"):
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                (error_lines if record.get("error") else ok_lines).append(raw + b"\n")
        output = self.add_file(b"".join(ok_lines), f"{batch_id}_output.jsonl", "batch_output") if ok_lines else None
        errors = self.add_file(b"".join(error_lines), f"{batch_id}_errors.jsonl", "batch_output") \
            if error_lines else None
        now = int(time.time())
        done = {"cancelled_at": now, "status": "cancelled"} if cancelled else {"completed_at": now,
                                                                              "status": "completed"}
        batch = read_json(self._batch_path(batch_id))
        self._update(batch_id, output_file_id=output and output["id"], error_file_id=errors and errors["id"],
                     request_counts={"total": batch["request_counts"]["total"], "completed": len(ok_lines),
                                     "failed": len(error_lines)}, **done)
        log.info("batch %s %s: %d ok, %d failed", batch_id, done["status"], len(ok_lines), len(error_lines))
