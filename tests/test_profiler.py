"""``interlace profile``: a measured profile of a tiny model is a valid,
loadable Profile with the engine's shapes; S follows its documented rule."""

import argparse

from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.native.profiler import (add_profile_arguments, measure_profile, run_profile,
                                                  saturation_point)
from interlace.engine_ext.policies import Profile


def test_saturation_point_rule():
    # seconds per token: 1, 0.25, 0.11, 0.1 -> within 15% of 0.1 from 64 on
    assert saturation_point([(1, 1.0), (8, 2.0), (64, 7.0), (256, 25.6)]) == 64


def test_measure_profile_quick(tiny_dirs, tmp_path):
    with NativeEngine.load(tiny_dirs["llama"][0], block_size=4, kv_cache_tokens=1024) as eng:
        prof = measure_profile(eng, quick=True)
        st = eng.call_sync(lambda fut: fut.set_result(eng.blocks.num_used))
    assert st == 0  # the measurement's blocks were given back
    assert prof.source == "measured" and prof.device.startswith(("cpu", "NVIDIA"))
    assert prof.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers * k/v * kv heads * head dim * float32
    assert prof.saturation_tokens in prof.fwd_tokens and prof.swap_s_per_block > 0
    assert list(prof.fwd_seconds) == sorted(prof.fwd_seconds)
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof


def test_run_profile_writes_json(tiny_dirs, tmp_path):
    p = argparse.ArgumentParser()
    add_profile_arguments(p)
    args = p.parse_args(["--model", str(tiny_dirs["llama"][0]), "--quick", "--out", str(tmp_path / "x.json"),
                         "--kv-cache-tokens", "512"])
    assert run_profile(args) == 0
    assert Profile.load(tmp_path / "x.json").source == "measured"
