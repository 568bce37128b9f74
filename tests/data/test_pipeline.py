"""The grain prompt pipeline: exact resume from a saved state, per-process sharding, epochs, padding."""

import json

import numpy as np
import pytest

from jaxrl_fp8.data.builtin_tokenizer import BOS_ID, PAD_ID, builtin_tokenizer
from jaxrl_fp8.data.pipeline import LoaderConfig, PromptLoader, pad_prompts
from jaxrl_fp8.data.synthetic import make_task, synthetic_splits


@pytest.fixture(scope="module")
def setup():
    train, _ = synthetic_splits(make_task("copy", 2), seed=3)  # 90 prompts
    return train, builtin_tokenizer()


def _uids(loader, n):
    return [next(loader).uids.tolist() for _ in range(n)]


def test_batch_contents(setup):
    records, tok = setup
    batch = next(PromptLoader(records, tok, LoaderConfig(batch_size=5, seed=0)))
    assert len(batch) == 5 and batch.uids.dtype == np.int64
    by_uid = {r.uid: r for r in records}
    for uid, text, ids, answer in zip(batch.uids, batch.prompts, batch.prompt_ids, batch.answers):
        assert text == by_uid[uid].prompt and answer == by_uid[uid].answer
        assert ids.dtype == np.int32 and ids.tolist() == tok.encode(text, add_special_tokens=True)


def test_resume_reproduces_the_next_batches(setup):
    records, tok = setup
    cfg = LoaderConfig(batch_size=8, seed=7)
    loader = PromptLoader(records, tok, cfg)
    _uids(loader, 13)  # cross an epoch boundary (11 batches per epoch)
    state = json.loads(json.dumps(loader.get_state()))  # must survive JSON (checkpoint metadata)
    expected = _uids(loader, 25)
    resumed = PromptLoader(records, tok, cfg)
    resumed.set_state(state)
    assert _uids(resumed, 25) == expected
    fresh = PromptLoader(records, tok, cfg)
    assert _uids(fresh, 38)[13:] == expected  # and equals an uninterrupted run


def test_state_from_another_pipeline_is_refused(setup):
    records, tok = setup
    state = PromptLoader(records, tok, LoaderConfig(batch_size=8, seed=7)).get_state()
    other = PromptLoader(records, tok, LoaderConfig(batch_size=4, seed=7))
    with pytest.raises(ValueError, match="batch_size: saved 8 vs now 4"):
        other.set_state(state)
    with pytest.raises(ValueError, match="not a PromptLoader state"):
        other.set_state({"next_index": 3})


def test_epochs_are_reshuffled_permutations(setup):
    records, tok = setup
    loader = PromptLoader(records, tok, LoaderConfig(batch_size=10, seed=1))  # 90 = 9 batches per epoch
    epoch1 = sum(_uids(loader, 9), [])
    epoch2 = sum(_uids(loader, 9), [])
    assert sorted(epoch1) == sorted(epoch2) == sorted(r.uid for r in records)
    assert epoch1 != epoch2
    unshuffled = PromptLoader(records, tok, LoaderConfig(batch_size=10, shuffle=False))
    assert sum(_uids(unshuffled, 9), []) == [r.uid for r in records]


def test_process_shards_are_disjoint_and_equal(setup):
    records, tok = setup
    count = 4  # 90 prompts -> 22 per process, 2 dropped
    shards = []
    for index in range(count):
        loader = PromptLoader(records, tok, LoaderConfig(batch_size=11, seed=5, process_index=index,
                                                           process_count=count))
        assert loader.batches_per_epoch == 2
        shards.append(sum(_uids(loader, 2), []))
    flat = sum(shards, [])
    assert all(len(s) == 22 for s in shards) and len(set(flat)) == 88
    assert set(flat) == {r.uid for r in records[:88]}


def test_finite_epochs_end(setup):
    records, tok = setup
    loader = PromptLoader(records, tok, LoaderConfig(batch_size=40, num_epochs=2, shuffle=False))
    assert len(list(loader)) == 4  # 2 full batches per epoch, remainder dropped


def test_config_and_size_errors(setup):
    records, tok = setup
    with pytest.raises(ValueError, match="process_index=2"):
        LoaderConfig(batch_size=2, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="fewer than batch_size=100"):
        PromptLoader(records, tok, LoaderConfig(batch_size=100))


def test_max_prompt_tokens_drops_long_prompts(setup):
    records, tok = setup
    loader = PromptLoader(records, tok, LoaderConfig(batch_size=4, max_prompt_tokens=4))  # all are 4 tokens
    assert loader.num_dropped_too_long == 0
    with pytest.raises(ValueError, match="0 prompts"):
        PromptLoader(records, tok, LoaderConfig(batch_size=4, max_prompt_tokens=3))


def test_pad_prompts():
    ids = [np.array([1, 5, 6], np.int32), np.array([1, 7], np.int32)]
    left, lengths = pad_prompts(ids, PAD_ID)
    np.testing.assert_array_equal(left, [[1, 5, 6], [PAD_ID, 1, 7]])
    np.testing.assert_array_equal(lengths, [3, 2])
    right, _ = pad_prompts(ids, PAD_ID, side="right", length=4)
    np.testing.assert_array_equal(right, [[1, 5, 6, 0], [1, 7, 0, 0]])
    with pytest.raises(ValueError, match="more than length=2"):
        pad_prompts(ids, PAD_ID, length=2)
    assert BOS_ID == 1
