"""The stress job's plan: reproducible from the seed and iteration alone (every rank draws the same),
with empty ranks, full ones and counts that are not a multiple of the slot, batch-ready every k-th
call, and delays within their bounds."""

import pytest

from chunkring.errors import ChunkringUsageError
from chunkring_launch.config import from_table, load_table
from chunkring_launch.jobs.stress import CONFIG, SIDES, plan_iteration


def preset(**changes):
    return from_table(CONFIG, {**load_table("stress"), **changes}, job="stress")


def test_plan_is_a_function_of_seed_and_iteration():
    config = preset()
    assert [plan_iteration(config, i, 4) for i in range(50)] == [plan_iteration(config, i, 4) for i in range(50)]
    assert plan_iteration(config, 3, 4) != plan_iteration(preset(seed=1), 3, 4)


def test_token_counts_cover_the_edges():
    config = preset()
    counts = [n for i in range(400) for n in plan_iteration(config, i, 4).tokens]
    per_slot, most = config.stream_slot_tokens, config.max_tokens_per_rank
    assert all(0 <= n <= most for n in counts)
    assert 0 in counts and most in counts
    assert any(n % per_slot for n in counts) and any(n and n % per_slot == 0 for n in counts)
    assert any(-(-n // per_slot) > config.stream_slots for n in counts)  # calls that wrap the ring


def test_every_kth_call_is_batch_ready_or_a_graph_replay():
    config = preset(batch_every=3, graph_every=0)
    assert [plan_iteration(config, i, 2).mode for i in range(6)] == ["streamed", "streamed", "batch"] * 2
    assert all(plan_iteration(preset(batch_every=0, graph_every=0), i, 2).mode == "streamed" for i in range(20))
    modes = [plan_iteration(preset(batch_every=4, graph_every=3), i, 2).mode for i in range(12)]
    assert modes == ["streamed", "streamed", "graph", "batch", "streamed", "graph",
                     "streamed", "batch", "graph", "streamed", "streamed", "batch"]  # batch wins a tie


def test_delays_stay_in_bounds():
    config = preset(delay_probability=0.5, delay_cycles_max=1000)
    delays = [plan_iteration(config, i, 3).delay for i in range(200)]
    drawn = [d for d in delays if d is not None]
    assert 50 < len(drawn) < 150
    assert all(0 <= d.rank < 3 and d.side in SIDES and 1 <= d.cycles <= 1000 for d in drawn)
    assert {d.side for d in drawn} == set(SIDES)
    assert all(plan_iteration(preset(delay_probability=0.0), i, 3).delay is None for i in range(50))


@pytest.mark.parametrize("changes,field", [
    ({"iterations": 0}, "iterations"),                      # neither a count nor a duration
    ({"duration_s": 60.0}, "iterations"),                   # both
    ({"iterations": -1}, "iterations"),
    ({"batch_every": -1}, "batch_every"),
    ({"graph_every": 1}, "graph_every"),                    # the first call must be eager
    ({"delay_probability": 1.5}, "delay_probability"),
    ({"delay_cycles_max": 0}, "delay_cycles_max"),
    ({"chaos": "fire"}, "chaos"),
    ({"chaos_rank": -1}, "chaos_rank"),
    ({"chaos_iteration": 200}, "chaos_iteration"),          # never reached in 200 iterations
    ({"chaos": "delay", "chaos_delay_s": 1000.0}, "chaos_delay_s"),  # past the device watchdog
    ({"stream_slots": 8}, "stream_slots"),            # 6 chunks per call never wrap 8 slots
    ({"stream_slot_tokens": 600}, "stream_slot_tokens"),
    ({"payload": "fp4"}, "payload"),
    ({"iterations": 1.5}, "iterations"),
])
def test_stress_rejects(changes, field):
    with pytest.raises(ChunkringUsageError) as info:
        preset(**changes)
    assert info.value.field == field


def test_duration_mode_and_chaos_delay_within_the_watchdog(monkeypatch):
    assert preset(iterations=0, duration_s=30.0).duration_s == 30.0
    monkeypatch.setenv("CHUNKRING_TIMEOUT_S", "4")
    with pytest.raises(ChunkringUsageError, match="chaos_delay_s"):
        preset(chaos="delay", chaos_delay_s=5.0)
    assert preset(chaos="delay", chaos_delay_s=3.0).chaos == "delay"


def test_chaos_preset_kills_one_rank():
    config = from_table(CONFIG, load_table("chaos"), job="stress")
    assert (config.chaos, config.chaos_rank) == ("kill", 1)
    assert config.chaos_iteration < config.iterations
