from kiviq.engine.stop import StopMatcher


def feed(stops, deltas):
    m = StopMatcher(stops)
    out, stopped = "", False
    for d in deltas:
        emit, stopped = m.push(d)
        out += emit
        if stopped:
            return out, True
    return out + m.flush(), False


def test_no_stop_strings_passes_through():
    assert feed([], ["a", "b"]) == ("ab", False)


def test_stop_split_across_deltas_is_not_emitted():
    assert feed(["END"], ["hello E", "N", "D more"]) == ("hello ", True)


def test_partial_match_released_when_it_does_not_complete():
    m = StopMatcher(["END"])
    assert m.push("abcE") == ("abc", False)
    assert m.push("x") == ("Ex", False)


def test_earliest_of_several_stop_strings_wins():
    assert feed(["zz", "b"], ["a", "bzz"]) == ("a", True)


def test_held_text_flushed_at_end():
    assert feed(["END"], ["abc", "EN"]) == ("abcEN", False)
