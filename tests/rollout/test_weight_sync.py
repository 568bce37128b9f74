"""Versioned weight pushes over real HTTP: all servers move together, or none does."""

import numpy as np
import pytest
from fake_rollout_engine import FakeEngine, make_table, write_checkpoint

from jaxrl_fp8.rollout.http_server import start_in_thread
from jaxrl_fp8.rollout.sglang_client import RetryPolicy, SGLangClient
from jaxrl_fp8.rollout.types import GenerateRequest, SamplingParams
from jaxrl_fp8.rollout.weight_sync import WeightSyncConfig, WeightSyncError, WeightSynchronizer, torch_dtype_name

GREEDY = GenerateRequest(0, (3, 1, 4), SamplingParams(temperature=0.0, max_new_tokens=8), "probe")
FAST = WeightSyncConfig(retry_backoff_s=0.0)


class FlakyEngine(FakeEngine):
    """Fails the first `failures` loads, then works (a transient NFS hiccup)."""

    def __init__(self, failures, **kw):
        super().__init__(**kw)
        self.failures = failures

    def update_weights_from_disk(self, path, weight_version):
        if self.failures:
            self.failures -= 1
            raise OSError("transient read error")
        super().update_weights_from_disk(path, weight_version)


@pytest.fixture
def fleet3():
    engines = [FakeEngine(), FakeEngine(), FakeEngine()]
    servers = [start_in_thread(e) for e in engines]
    clients = [SGLangClient(s.url, retry=RetryPolicy(max_attempts=1), request_timeout_s=10) for s in servers]
    yield engines, servers, clients
    for s in servers:
        s.shutdown()


@pytest.fixture
def ckpts(tmp_path):
    tables = {name: make_table(seed) for seed, name in enumerate(["step1", "step2", "step3"], start=1)}
    paths = {name: write_checkpoint(str(tmp_path / f"{name}.npz"), t) for name, t in tables.items()}
    return tables, paths


def versions(clients):
    return [c.weight_version() for c in clients]


def outputs(clients):
    return [c.generate(GREEDY)[0] for c in clients]  # would hang (timeout) if a server stayed paused


def test_push_moves_every_server_and_changes_outputs(fleet3, ckpts):
    engines, _, clients = fleet3
    tables, paths = ckpts
    before = outputs(clients)
    report = WeightSynchronizer(clients, config=FAST).push_from_disk(paths["step1"], "v1")
    assert sorted(report.updated) == sorted(c.url for c in clients) and report.excluded == {}
    assert versions(clients) == ["v1"] * 3
    after = outputs(clients)
    want = FakeEngine(table=tables["step1"]).generate([list(GREEDY.prompt_ids)], GREEDY.sampling)[0]
    for b, a in zip(before, after):
        assert a.weight_version == "v1" and a.response_ids.tolist() == want.response_ids.tolist()
        assert a.response_ids.tolist() != b.response_ids.tolist()
    assert all(not e.paused and e.cache_flushes == 1 for e in engines)


def test_partial_failure_rolls_every_server_back(fleet3, ckpts):
    engines, _, clients = fleet3
    tables, paths = ckpts
    sync = WeightSynchronizer(clients, config=FAST)
    sync.push_from_disk(paths["step1"], "v1")
    engines[1].fail_paths = ("step2",)  # server 1 cannot read the new checkpoint
    with pytest.raises(WeightSyncError) as e:
        sync.push_from_disk(paths["step2"], "v2")
    msg = str(e.value)
    assert clients[1].url in msg and "rolled back to 'v1'" in msg, msg
    assert list(e.value.failed) == [clients[1].url] and e.value.quarantine == []
    assert versions(clients) == ["v1"] * 3  # one consistent version
    want = FakeEngine(table=tables["step1"]).generate([list(GREEDY.prompt_ids)], GREEDY.sampling)[0]
    assert all(o.response_ids.tolist() == want.response_ids.tolist() for o in outputs(clients))
    assert not any(e.paused for e in engines)  # generation was continued after the failure
    assert (sync.previous_checkpoint, sync.previous_version) == (paths["step1"], "v1")


def test_failed_rollback_quarantines_the_stuck_server(fleet3, ckpts):
    engines, _, clients = fleet3
    _, paths = ckpts
    sync = WeightSynchronizer(clients, config=FAST)
    sync.push_from_disk(paths["step1"], "v1")
    engines[1].fail_paths = ("step2",)
    engines[2].fail_paths = ("step1",)  # takes step2, then cannot go back
    with pytest.raises(WeightSyncError, match="rollback to 'v1' also failed") as e:
        sync.push_from_disk(paths["step2"], "v2")
    assert e.value.quarantine == [clients[2].url]
    assert versions(clients) == ["v1", "v1", "v2"]  # the quarantined one is the odd one out


def test_first_push_failure_without_previous_checkpoint_quarantines_the_failed_server(fleet3, ckpts):
    engines, _, clients = fleet3
    _, paths = ckpts
    engines[0].fail_paths = ("step1",)
    with pytest.raises(WeightSyncError, match="no previous checkpoint to roll back to") as e:
        WeightSynchronizer(clients, config=FAST).push_from_disk(paths["step1"], "v1")
    assert e.value.quarantine == [clients[0].url]
    assert versions(clients) == ["v0", "v1", "v1"]


def test_transient_failure_is_retried(ckpts):
    _, paths = ckpts
    engines = [FlakyEngine(1), FakeEngine()]
    servers = [start_in_thread(e) for e in engines]
    try:
        clients = [SGLangClient(s.url, retry=RetryPolicy(max_attempts=1)) for s in servers]
        report = WeightSynchronizer(clients, config=FAST).push_from_disk(paths["step1"], "v1")
        assert report.attempts == {clients[0].url: 2, clients[1].url: 1}
        assert versions(clients) == ["v1", "v1"]
    finally:
        for s in servers:
            s.shutdown()


def test_unreachable_server_fails_or_is_excluded_by_policy(fleet3, ckpts):
    _, servers, clients = fleet3
    _, paths = ckpts
    servers[2].shutdown()
    with pytest.raises(WeightSyncError, match="could not pause generation"):
        WeightSynchronizer(clients, config=FAST).push_from_disk(paths["step1"], "v1")
    assert versions(clients[:2]) == ["v0", "v0"]  # nothing changed
    report = WeightSynchronizer(clients, config=WeightSyncConfig(unreachable="exclude")).push_from_disk(paths["step1"], "v1")
    assert list(report.excluded) == [clients[2].url] and versions(clients[:2]) == ["v1", "v1"]


def test_version_mismatch_after_load_counts_as_failure(fleet3, ckpts):
    engines, _, clients = fleet3
    _, paths = ckpts

    def lying(path, version, engine=engines[0], real=engines[0].update_weights_from_disk):
        real(path, version + "-stale")

    engines[0].update_weights_from_disk = lying
    with pytest.raises(WeightSyncError, match="reports weight_version 'v1-stale' after loading 'v1'"):
        WeightSynchronizer(clients, config=FAST).push_from_disk(paths["step1"], "v1")


def test_torch_dtype_names_for_distributed_updates():
    import ml_dtypes

    assert torch_dtype_name(np.zeros(2, np.float32)) == "float32"
    assert torch_dtype_name(np.zeros(2, ml_dtypes.bfloat16)) == "bfloat16"
    assert torch_dtype_name(np.zeros(2, ml_dtypes.float8_e4m3fn)) == "float8_e4m3fn"
    with pytest.raises(ValueError, match="cannot be sent"):
        torch_dtype_name(np.zeros(2, np.complex64))
