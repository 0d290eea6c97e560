"""InferCept's equation 4 as published: T_fwd(C/n) is a chunk's *added*
iteration time, so n * T_fwd(C/n) <= T_fwd(C) and chunked discard never costs
more than discarding at once.  Every user of the waste equations (min-waste,
LAMPS' handling term) goes through the one implementation."""

import pytest

from interlace.engine_ext.policies import BUILTIN_PROFILES, LAMPS, BatchState, Handling, MinWaste, Profile, RankState
from interlace.engine_ext.policies.interception import (best_case_waste, recompute_chunks, waste_chunked_discard,
                                                        waste_discard, waste_of_discard)
from interlace.engine_ext.policies.ranking import SchedInfo


def flat_below_s(s=256):
    """A GPU-like profile: 10 ms per iteration up to S tokens, then linear."""
    return Profile(model="flat", device="toy", source="derived (test)", block_size=16, kv_bytes_per_token=1,
                   kv_capacity_tokens=100_000, max_batched_tokens=4096, fwd_tokens=(1, s, 4096),
                   fwd_seconds=(0.01, 0.01, 0.01 * 4096 / s), fwd_s_per_context_token=1e-7,
                   swap_s_per_block=0.001, saturation_tokens=s)


@pytest.mark.parametrize("c_i,decodes", [(2000, 100), (500, 1), (4000, 250), (17, 3)])
def test_the_papers_inequality_holds_on_a_profile_flat_below_s(c_i, decodes):
    """Chunks ride iterations the running decodes make anyway (with no decode
    running, a chunk is its own iteration and nobody else's memory waits on it)."""
    p = flat_below_s()
    n = recompute_chunks(c_i, p, decodes)
    chunk = -(-c_i // n)
    assert decodes + chunk <= max(p.saturation_tokens, decodes + p.block_size)
    # n * T_fwd(C/n) <= T_fwd(C), with T_fwd(C/n) the chunk's added time beside the decodes
    assert n * p.added_time(chunk, decodes) <= p.t_fwd(c_i) + 1e-12
    # hence eq. 4 <= eq. 1 for any C_other
    for c_other in (0, 1000, 60_000):
        assert waste_chunked_discard(c_i, c_other, p, decodes) <= waste_discard(c_i, c_other, p) + 1e-9


def test_the_reviews_h100_example():
    """C = 2000, C_other = 60k, 100 decodes on the derived H100 GPT-J profile:
    2652 token-s discarding at once, 43 chunked (the misread gave 6688)."""
    p = BUILTIN_PROFILES["h100-gpt-j-6b"]()
    assert waste_discard(2000, 60_000, p) == pytest.approx(2652, rel=0.01)
    assert waste_chunked_discard(2000, 60_000, p, 100) == pytest.approx(p.t_fwd(2000) * 2000 / 2, rel=1e-9)
    assert waste_chunked_discard(2000, 60_000, p, 100) == pytest.approx(43, rel=0.02)


def test_min_waste_discards_where_the_misread_preserved():
    """Without a swap, a 1 s call of a 2000-token context beside 60k others:
    preserve wastes 2000 token-s, chunked discard 43: discard (the misread
    charged 6688 and preserved)."""
    p = BUILTIN_PROFILES["h100-gpt-j-6b"]()
    pol = MinWaste(p, swap=False)
    from interlace.engine_ext.policies import InterceptedContext
    batch = BatchState(context_tokens=60_000, decode_tokens=100, batched_tokens=100)
    assert pol.decide(InterceptedContext(2000, expected_duration_s=1.0, id="a"), batch) is Handling.DISCARD
    # the unchunked policy (vLLM's discard) is judged by eq. 1: 2652 > 2000, so it would preserve
    assert waste_of_discard(2000, 60_000, p, 100, chunked=False) > 2000 > waste_of_discard(2000, 60_000, p, 100)


def test_lamps_charges_discard_through_the_same_equation():
    """LAMPS' handling term for a predicted discard is eq. 4 (chunked) or eq. 1,
    whichever the interception policy runs: the number it adds is the one
    best_case_waste gives, in iterations."""
    p = flat_below_s()

    class Item:
        arrival = 0.0

        def __init__(self):
            self.sched = SchedInfo(context_len=1000, expected_output=10, expected_tool_s=5.0,
                                   handling=Handling.DISCARD)

    for chunked in (True, False):
        ic = MinWaste(p, swap=False)
        ic.chunked_recompute = chunked
        lamps = LAMPS(p, ic, horizon="segment")
        state = RankState(iteration_s=0.01, batch_context_tokens=30_000)
        it = Item()
        area = 10 * 1000 + 10 * 11 / 2
        expect = best_case_waste(Handling.DISCARD, 1010, 5.0, BatchState(context_tokens=30_000), p,
                                 chunked=chunked) / 0.01
        assert lamps.score(it, state) == pytest.approx(area + expect)
    # and the two readings differ by eq. 1's whole-iteration charge of the others' memory
    assert waste_of_discard(1010, 30_000, p, 0, chunked=False) > waste_of_discard(1010, 30_000, p, 0, chunked=True)
