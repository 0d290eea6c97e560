"""The native trace bench's driver (``bench/trace.py`` ``_drive_request``)
gives every segment its own hint: the first at ``generate``, the next at
each ``resume(..., hint=)`` -- the trace's true values for the oracle, the
run's shared SegmentPredictor's (fed at each pause, call and finish, as the
gateway feeds it) online.  On the embedded model, a few tokens per request."""

import asyncio
import time

import pytest

from interlace.bench import trace as bench_trace
from interlace.engine_ext.policies.hints import SegmentPredictor
from interlace.engine_ext.protocol import RequestHint
from interlace.engine_ext.sim.traces import Segment, TraceRequest


def three_segments(rid: str) -> TraceRequest:
    """Two calls of 0.02 s; the first returns 4 tokens, the second 3 (+ a 2-token user turn)."""
    return TraceRequest(rid, [Segment(8, 3, 0.02, 4), Segment(0, 3, 0.02, 3), Segment(2, 2)], 0.0, "calc")


@pytest.fixture
def resumes(smol_engine, monkeypatch):
    """The hints the driver passes at each resume (the engine's own resume runs)."""
    seen = []
    real = smol_engine.resume

    async def resume(context_id, token_ids=(), hint=None):
        seen.append(hint)
        await real(context_id, token_ids, hint=hint)
    monkeypatch.setattr(smol_engine, "resume", resume)
    return seen


def drive(engine, req, predictor=None):
    records, problems = [], []
    marker = bench_trace.pause_marker(engine.tokenizer, engine.eos_token_ids)
    asyncio.run(bench_trace._drive_request(engine, req, time.monotonic(), marker=marker, vocab=engine.vocab_size,
                                           seed=0, time_scale=1.0, hint_cls=RequestHint, records=records,
                                           problems=problems, predictor=predictor))
    assert problems == [] and len(records) == 1
    return records[0]


def test_oracle_hint_per_segment_at_resume(smol_engine, resumes):
    drive(smol_engine, three_segments("o"))
    first, second = resumes
    # segment 1: 3 tokens, then a 0.02 s call; segment 2 (the last, added 3 + 2 tokens) follows
    assert (first.expected_output, first.expected_tool, first.expected_tool_s) == (3, "calc", 0.02)
    assert first.future == ((2, None, 5),)
    assert (second.expected_output, second.expected_tool, second.expected_tool_s, second.future) == (2, None, None, ())


def test_online_hints_learned_from_finished_requests(smol_engine, resumes):
    predictor = SegmentPredictor()
    drive(smol_engine, three_segments("a"), predictor)
    # nothing finished yet: no call predicted at request a's resumes (the ranking falls back to the area)
    assert [h.expected_tool_s for h in resumes] == [None, None]
    assert resumes[0].expected_output == 3  # segment 0 of a was observed at its pause
    assert predictor.rounds.p_continue("calc", 0) == 1.0  # a's three segments, observed at its finish
    drive(smol_engine, three_segments("b"), predictor)
    first, second = resumes[2:]
    # b's segment 1 is predicted to end in a call of about a's calls' time (waited: >= 0.02 s), one segment after it
    assert first.expected_tool_s is not None and first.expected_tool_s >= 0.02
    assert first.expected_output is not None and len(first.future) == 1 and first.future[0][1] is None
    # b's last segment: a had no call after its third segment
    assert second.expected_tool_s is None and second.future == ()
