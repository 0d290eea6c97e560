"""Small cost-model profiles the policy and simulator tests share."""

from interlace.engine_ext.policies import Profile


def small_profile(**kw):
    """4-token blocks, 256 tokens of KV, 10-20 ms iterations, S = 16; ``kw`` overrides any field."""
    d = dict(model="tiny", device="sim", source="derived (test)", block_size=4, kv_bytes_per_token=1,
             kv_capacity_tokens=256, max_batched_tokens=64, fwd_tokens=(1, 64), fwd_seconds=(0.01, 0.02),
             fwd_s_per_context_token=0.0, swap_s_per_block=0.004, saturation_tokens=16)
    d.update(kw)
    return Profile(**d)
