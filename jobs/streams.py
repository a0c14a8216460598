"""Replay-log policy shared by the publisher (worker) and readers (client)."""

from kiviq.jobs.models import MAX_NEW_TOKENS

# One event per generated token plus a few control events; the cap only ever
# trims a log that outgrew any valid job, so a reader always sees every event.
REPLAY_MAX_EVENTS = MAX_NEW_TOKENS + 64
REPLAY_TTL_S = 24 * 3600
