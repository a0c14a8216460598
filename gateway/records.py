"""The Batch API's records (file and batch objects), one JSON file each in a
directory: ids, atomic writes, reads, and OpenAI's list pages over them."""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

ORDERS = ("asc", "desc")


def new_id(prefix: str) -> str:
    """``prefix-`` and 24 hex digits: the creation time in ns, then random ones.
    Ids sort in creation order, so records made within one second (``created_at``
    counts seconds, as OpenAI's does) still list newest first."""
    return f"{prefix}-{time.time_ns():016x}{uuid.uuid4().hex[:8]}"


def safe_id(value: str, prefix: str) -> bool:
    """Whether ``value`` is an id of this kind and nothing that could name another path."""
    return value.startswith(prefix + "-") and value[len(prefix) + 1:].isalnum()


def write_json(path: str, obj: dict[str, Any]) -> None:
    """Atomically (a reader never sees half a record)."""
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def read_all(directory: str) -> list[dict[str, Any]]:
    """Every record in ``directory`` (``*.json``; one deleted meanwhile is skipped)."""
    records = []
    for name in os.listdir(directory):
        if name.endswith(".json"):
            record = read_json(os.path.join(directory, name))
            if record is not None:
                records.append(record)
    return records


def page(records: list[dict[str, Any]], limit: int, after: str | None = None,
         order: str = "desc") -> tuple[list[dict[str, Any]], bool]:
    """The ``limit`` records that follow the record ``after`` (none: from the
    first) in ``order`` of creation, and whether more follow them. An ``after``
    that names no record gives an empty page."""
    records = sorted(records, key=lambda r: (r["created_at"], r["id"]), reverse=order == "desc")
    if after is not None:
        ids = [r["id"] for r in records]
        records = records[ids.index(after) + 1:] if after in ids else []
    return records[:limit], len(records) > limit


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's list shape (a cursor page: the SDK asks again ``after=last_id``)."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
