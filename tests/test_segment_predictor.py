"""The online segment predictor the gateway, the simulator and the
benchmarks feed LAMPS with (engine_ext/policies/hints.py)."""

import pytest

from interlace.engine_ext.policies import ToolDurations
from interlace.engine_ext.policies.hints import RoundsLeft, SegmentPrediction, SegmentPredictor


def test_it_knows_nothing_before_any_observation():
    p = SegmentPredictor()
    assert p.predict("app", 100) == SegmentPrediction()


def test_a_call_is_predicted_from_the_apps_finished_requests():
    p = SegmentPredictor()
    for _ in range(3):  # requests of 3 segments: two calls of 2 s each adding 50 tokens, 20 tokens per segment
        for seg in range(3):
            p.observe_segment("agent", 100, 20)
            if seg < 2:
                p.observe_call("agent", "search", 2.0, result_tokens=50)
        p.observe_finish("agent", 3)
    first = p.predict("agent", 100, 0)
    assert first.expected_output == 20 and first.expected_tool_s == pytest.approx(2.0)
    # two segments follow the first: one more call, then the last segment without one
    assert [(o, s is not None, r) for o, s, r in first.future] == [(20, True, 50), (20, False, 50)]
    last = p.predict("agent", 200, 2)
    assert last.expected_tool_s is None and last.future == ()  # requests of this app end after 3 segments
    # no tools offered: never a call term
    assert p.predict("agent", 100, 0, may_call=False).expected_tool_s is None
    # the segment horizon leaves the later segments out
    assert p.predict("agent", 100, 0, horizon=False).future == ()


def test_a_named_tool_uses_its_own_learned_time():
    d = ToolDurations()
    p = SegmentPredictor(durations=d)
    p.observe_call("agent", "slow", 9.0)
    p.observe_call("agent", "fast", 1.0)
    assert p.predict("agent", 10, 0, tool="slow").expected_tool_s == pytest.approx(9.0)
    assert p.call_seconds("agent") == pytest.approx(5.0)  # the app's mean call
    # an engine that learns per-tool times itself shares the object: the gateway must not count twice
    p.observe_call("agent", "slow", 3.0, tool_durations=False)
    assert d.estimate("slow") == pytest.approx(9.0)


def test_rounds_left_conditions_on_the_segments_done():
    r = RoundsLeft()
    for n in (1, 1, 1, 4):
        r.observe("a", n)
    assert r.p_continue("a", 0) == pytest.approx(0.25)   # most requests of "a" make no call
    assert r.p_continue("a", 1) == pytest.approx(1.0)    # but one that made a call goes on
    assert r.expected_left("a", 1) == pytest.approx(2.0)
    assert r.p_continue("a", 4) is None                   # nobody got that far
    r.observe("a", 0)  # not a request: ignored
    assert r.p_continue("b", 0) is None


def test_bad_observations_are_ignored():
    p = SegmentPredictor()
    p.observe_call("a", "t", float("nan"))
    p.observe_call("a", "t", -1.0)
    assert p.call_seconds("a", "t") is None
