"""SGLangFleet over real HTTP: failover when a server process dies, exactly-once results, versions."""

import threading
import time

import numpy as np
import pytest
from fake_rollout_engine import FakeEngine, make_table, wait_for, write_checkpoint

from jaxrl_fp8.rollout.fleet import AllServersDead, FleetConfig, RolloutFailed, SGLangFleet
from jaxrl_fp8.rollout.http_server import ServerConfig, start_in_thread
from jaxrl_fp8.rollout.sglang_client import RetryPolicy, RoutedExpertsUnsupported
from jaxrl_fp8.rollout.types import SamplingParams
from jaxrl_fp8.rollout.weight_sync import WeightSyncConfig, WeightSyncError

QUICK = FleetConfig(
    max_in_flight_per_server=4,
    request_timeout_s=20.0,
    connect_timeout_s=2.0,
    client_retry=RetryPolicy(max_attempts=1),
    reprobe_interval_s=0.5,
    probe_timeout_s=1.0,
    all_dead_timeout_s=1.5,
    show_progress=False,
    sync=WeightSyncConfig(unreachable="exclude", retry_backoff_s=0.0),
)


def prompts_of(count, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 64, size=rng.integers(1, 6)).tolist() for _ in range(count)]


def check_against_reference(samples, prompts, sampling, tables_by_version, routed=False):
    """Every prompt has exactly sampling.n samples, in order, each equal to the reference engine's."""
    assert len(samples) == len(prompts) * sampling.n
    for i, prompt in enumerate(prompts):
        group = samples[i * sampling.n : (i + 1) * sampling.n]
        assert [s.prompt_index for s in group] == [i] * sampling.n
        assert [s.sample_index for s in group] == list(range(sampling.n))
        for s in group:
            ref = FakeEngine(table=tables_by_version[s.weight_version], weight_version=s.weight_version)
            want = ref.generate([prompt], sampling, return_routed_experts=routed)[s.sample_index]
            assert s.prompt_ids.tolist() == prompt
            assert s.response_ids.tolist() == want.response_ids.tolist()
            assert s.rollout_logprobs.tobytes() == want.rollout_logprobs.tobytes()
            if routed:
                np.testing.assert_array_equal(s.routed_experts, want.routed_experts)


def test_fleet_of_three_survives_a_server_killed_mid_rollout(server_procs):
    procs = server_procs([(f"s{i}", "--step-delay-s", "0.02") for i in range(3)])
    prompts = prompts_of(48)
    sampling = SamplingParams(temperature=0.8, max_new_tokens=12, n=2, seed=7, ignore_eos=True)
    victim = procs[0]
    with SGLangFleet([p.url for p in procs], config=QUICK, routed_experts_shape=(3, 2)) as fleet:
        def kill_when_busy():
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # kill once the victim has finished some work
                if fleet.last_stats.completed_per_server[victim.url] >= 2:
                    break
                time.sleep(0.01)
            victim.kill()

        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        samples = fleet.generate(prompts, sampling, return_routed_experts=True)
        killer.join()
        stats = fleet.last_stats
    assert victim.proc.poll() is not None  # really dead (SIGKILL)
    check_against_reference(samples, prompts, sampling, {"v0": make_table(0)}, routed=True)
    assert stats.requests == 96 and sum(stats.completed_per_server.values()) == 96  # each completed once
    assert stats.duplicates_dropped == 0
    assert stats.resent_after_failure >= 1, stats  # its in-flight requests were re-sent
    assert victim.url in stats.servers_marked_dead
    assert stats.completed_per_server[victim.url] >= 2
    assert all(stats.completed_per_server[p.url] > 0 for p in procs[1:])


def test_all_servers_dead_is_a_clear_error(server_procs):
    procs = server_procs([("d0",), ("d1",)])
    for p in procs:
        p.kill()
    with SGLangFleet([p.url for p in procs], config=QUICK) as fleet:
        start = time.monotonic()
        with pytest.raises(AllServersDead, match="every server of the fleet is down") as e:
            fleet.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        assert time.monotonic() - start < 10
    assert all(p.url in str(e.value) for p in procs)


def test_missing_routed_experts_support_fails_before_the_rollout(server_procs):
    good = start_in_thread(FakeEngine())
    (bad,) = server_procs([("norouting", "--no-routed-experts")])
    try:
        with SGLangFleet([good.url, bad.url], config=QUICK) as fleet:
            with pytest.raises(RoutedExpertsUnsupported, match=rf"{bad.url}.*--enable-return-routed-experts"):
                fleet.generate([[1, 2]], SamplingParams(max_new_tokens=2), return_routed_experts=True)
            assert fleet.last_stats.sends == 0
            # Without replay the same fleet works.
            assert len(fleet.generate([[1, 2]], SamplingParams(max_new_tokens=2))) == 1
    finally:
        good.shutdown()


def test_rejected_request_fails_the_rollout_with_the_server_message():
    srv = start_in_thread(FakeEngine())
    try:
        with SGLangFleet([srv.url], config=QUICK) as fleet:
            with pytest.raises(RolloutFailed, match=r"prompt 1.*out of the vocabulary"):
                fleet.generate([[1, 2], [1, 999]], SamplingParams(max_new_tokens=2))
    finally:
        srv.shutdown()


def test_least_outstanding_balancing_uses_every_server():
    servers = [start_in_thread(FakeEngine(step_delay_s=0.01)) for _ in range(3)]
    try:
        with SGLangFleet([s.url for s in servers], config=QUICK) as fleet:
            prompts = prompts_of(30, seed=1)
            sampling = SamplingParams(temperature=1.0, max_new_tokens=5, n=3)  # unseeded: one request per prompt
            samples = fleet.generate(prompts, sampling)
            assert len(samples) == 90 and fleet.last_stats.requests == 30
            assert [s.prompt_index for s in samples] == [i for i in range(30) for _ in range(3)]
            counts = fleet.last_stats.completed_per_server
            assert sorted(counts) == sorted(s.url for s in servers) and min(counts.values()) >= 5, counts
    finally:
        for s in servers:
            s.shutdown()


class GatedEngine(FakeEngine):
    """Blocks its `block_at`-th batch until `gate` opens, so a test can pause while requests are queued."""

    def __init__(self, block_at: int, **kw):
        super().__init__(**kw)
        self.block_at, self.calls = block_at, 0
        self.blocked, self.gate = threading.Event(), threading.Event()

    def generate(self, prompts, sampling, *, return_routed_experts=False):
        self.calls += 1
        if self.calls == self.block_at:
            self.blocked.set()
            assert self.gate.wait(30), "test never opened the gate"
        return super().generate(prompts, sampling, return_routed_experts=return_routed_experts)


def test_weight_push_mid_rollout_never_mixes_versions(tmp_path):
    """Deterministic interleaving: each server runs two batches at v0, blocks in its third with requests
    queued behind it, the push pauses (abort mode answers the queued ones), then the batch finishes at v0
    and everything after it - the aborted requests re-sent - runs at v1."""
    table1 = make_table(11)
    ckpt1 = write_checkpoint(str(tmp_path / "step1.npz"), table1)
    engines = [GatedEngine(block_at=3, step_delay_s=0.002) for _ in range(2)]
    servers = [start_in_thread(e, config=ServerConfig(max_batch_prompts=2, max_prompts_per_request=2)) for e in engines]
    try:
        with SGLangFleet([s.url for s in servers], config=QUICK, current_checkpoint=None) as fleet:
            prompts = prompts_of(40, seed=2)
            sampling = SamplingParams(temperature=0.7, max_new_tokens=10, seed=3, ignore_eos=True)
            out = {}
            t = threading.Thread(target=lambda: out.setdefault("samples", fleet.generate(prompts, sampling)))
            t.start()
            for e, s in zip(engines, servers):
                wait_for(lambda: e.blocked.is_set() and s.batcher.queued_prompts >= 1, f"a queue behind {s.url}")
            push = threading.Thread(target=fleet.update_weights_from_disk, args=(ckpt1, "v1"))
            push.start()
            for e, s in zip(engines, servers):  # the pause has answered the queued requests with "abort"
                wait_for(lambda: e.paused and s.batcher.queued_prompts == 0, f"the pause of {s.url}")
            for e in engines:
                e.gate.set()
            push.join(30)
            assert not push.is_alive()
            t.join(30)
            stats = fleet.last_stats
        samples = out["samples"]
        assert {s.weight_version for s in samples} == {"v0", "v1"}
        check_against_reference(samples, prompts, sampling, {"v0": make_table(0), "v1": table1})
        assert stats.resent_after_abort >= 2, stats  # at least one queued request per server
        assert [e.weight_version for e in engines] == ["v1", "v1"] and not any(e.paused for e in engines)
    finally:
        for e in engines:
            e.gate.set()
        for s in servers:
            s.shutdown()


def test_dead_server_is_resynced_before_it_rejoins(tmp_path):
    ckpt1 = write_checkpoint(str(tmp_path / "step1.npz"), make_table(21))
    ckpt2 = write_checkpoint(str(tmp_path / "step2.npz"), make_table(22))
    a, b = start_in_thread(FakeEngine()), start_in_thread(FakeEngine())
    port_b = b.port
    b2 = None
    try:
        with SGLangFleet([a.url, b.url], config=QUICK) as fleet:
            fleet.update_weights_from_disk(ckpt1, "v1")
            b.shutdown()  # b dies; the next push leaves it out
            fleet.update_weights_from_disk(ckpt2, "v2")
            assert fleet.live_servers() == [a.url] and fleet.weight_version == "v2"
            b2_engine = FakeEngine()  # comes back on the same port with its initial weights (v0)
            b2 = start_in_thread(b2_engine, port=port_b)
            assert fleet.check_health() == {a.url: True, b.url: True}
            assert b2_engine.weight_version == "v2" and b2_engine.model_path == ckpt2
            samples = fleet.generate(prompts_of(12, seed=3), SamplingParams(max_new_tokens=3))
            assert {s.weight_version for s in samples} == {"v2"}
            assert fleet.last_stats.completed_per_server[b.url] > 0
    finally:
        a.shutdown()
        if b2 is not None:
            b2.shutdown()


def test_failed_push_through_the_fleet_keeps_one_version(tmp_path):
    ckpt1 = write_checkpoint(str(tmp_path / "step1.npz"), make_table(31))
    ckpt2 = write_checkpoint(str(tmp_path / "step2.npz"), make_table(32))
    engines = [FakeEngine(), FakeEngine(fail_paths=("step2",))]
    servers = [start_in_thread(e) for e in engines]
    try:
        with SGLangFleet([s.url for s in servers], config=QUICK) as fleet:
            fleet.update_weights_from_disk(ckpt1, "v1")
            with pytest.raises(WeightSyncError, match=servers[1].url):
                fleet.update_weights_from_disk(ckpt2, "v2")
            assert [e.weight_version for e in engines] == ["v1", "v1"]
            assert fleet.weight_version == "v1" and fleet.current_checkpoint == ckpt1
            assert {s.weight_version for s in fleet.generate([[1, 2]] * 4, SamplingParams(max_new_tokens=2))} == {"v1"}
    finally:
        for s in servers:
            s.shutdown()
