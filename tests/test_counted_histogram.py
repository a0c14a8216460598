"""``CountedHistogram`` (observations with a count) exports what the library's own
``Histogram`` exports for the same observations made one by one."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kiviq.worker.counted_histogram import CountedHistogram
from kiviq.worker.metrics import histogram_stats

BUCKETS = (0.001, 0.01, 0.1, 1.0)
OBSERVED = [(0.0005, 3), (0.001, 2), (0.0010001, 1), (0.05, 64), (1.0, 1), (7.5, 2), (0.0, 1)]


def test_counts_export_like_the_librarys_histogram_observed_one_by_one():
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("kiviq:itl_seconds", "Gaps.", ["model_name"], buckets=BUCKETS, registry=theirs)
    counted = CountedHistogram("kiviq:itl_seconds", "Gaps.", BUCKETS, {"model_name": "m"}, ours)
    for value, count in OBSERVED:
        for _ in range(count):
            reference.labels("m").observe(value)
        counted.observe(value, count)
    counted.observe(0.2, 0)  # nothing
    text, expected = generate_latest(ours).decode(), generate_latest(theirs).decode()

    def lines(t: str) -> list[str]:  # the sum apart: value x count rounds unlike repeated additions
        return [line for line in t.splitlines() if "_sum{" not in line]

    assert lines(text) == lines(expected) and len(lines(text)) == len(expected.splitlines()) - 1
    assert 'le="0.001",model_name="m"} 6.0' in text  # a value on a bound counts in that bucket
    ours_stats, theirs_stats = histogram_stats(counted), histogram_stats(reference)
    assert ours_stats[0] == theirs_stats[0] and ours_stats[2] == theirs_stats[2] == 74
    assert ours_stats[1] == pytest.approx(theirs_stats[1], rel=1e-12)


def test_buckets_must_increase():
    with pytest.raises(ValueError):
        CountedHistogram("h", "h", (0.1, 0.01), {}, CollectorRegistry())
