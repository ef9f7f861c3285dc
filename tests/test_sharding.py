"""Sharding callbacks and the validation of their results."""

from __future__ import annotations

import logging
from typing import List

import numpy as np
import pytest

import shardckpt
from shardckpt import (
    CheckpointOptions,
    MaxShardSizePolicy,
    ShardableTensor,
    ShardByDevicePolicy,
    ShardByTaskPolicy,
    ShardingCallback,
)
from shardckpt.errors import InvalidArgumentError, ShardingValidationError
from shardckpt.sharding import validate_shards
from shardckpt.sharding.callback import Shard


def _st(key: str, value, device: str = "/task:0/device:CPU:0", slice_spec: str = "") -> ShardableTensor:
    return ShardableTensor.from_value(key, np.asarray(value), device=device, slice_spec=slice_spec)


def _specs(shards: List[Shard]) -> List[dict]:
    return [{k: sorted(v) for k, v in shard.items()} for shard in shards]


# -- built-in policies ------------------------------------------------------------

def test_shard_by_task_returns_one_shard_with_everything() -> None:
    tensors = [_st("a", np.ones(3)), _st("b", np.zeros((2, 2)), device="/task:0/device:CPU:1")]
    shards = ShardByTaskPolicy()(tensors)
    assert _specs(shards) == [{"a": [""], "b": [""]}]
    assert ShardByTaskPolicy().description == "Split tensors into shards based on their device spec task."


def test_shard_by_device_groups_by_device_in_order() -> None:
    tensors = [_st("a", 1.0, "/task:0/device:CPU:1"), _st("b", 2.0, "/task:0/device:CPU:0"),
               _st("c", 3.0, "/task:0/device:CPU:1")]
    assert _specs(ShardByDevicePolicy()(tensors)) == [{"a": [""], "c": [""]}, {"b": [""]}]


def test_max_shard_size_matches_tensorflow_worked_example() -> None:
    # spec §8.3: float32[10,4] with max 40 bytes -> 4 slices in 4 shards, in this order
    big = np.arange(40, dtype=np.float32).reshape(10, 4)
    shards = MaxShardSizePolicy(40)([_st("big", big), _st("n", np.int64(3))])
    assert _specs(shards) == [{"big": ["10 4 0,10:0,1"]}, {"big": ["10 4 0,10:1,1"]},
                              {"big": ["10 4 0,5:2,2"]}, {"big": ["10 4 5,5:2,2"]}, {"n": [""]}]
    np.testing.assert_array_equal(shards[2]["big"]["10 4 0,5:2,2"], big[0:5, 2:4])


def test_max_shard_size_splits_strings_like_tensorflow() -> None:
    # spec §8.3: a [10,3,7,1]-byte string vector with max 20 -> slices [0:2] and [2:4]
    s = np.array([b"x" * 10, b"y" * 3, b"z" * 7, b"w"], dtype=object)
    shards = MaxShardSizePolicy(20)([_st("s", s)])
    assert _specs(shards) == [{"s": ["4 0,2"]}, {"s": ["4 2,2"]}]


def test_max_shard_size_never_loops_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    # TF 2.21 loops forever on both of these (spec §8.3).
    cube = np.arange(24, dtype=np.float32).reshape(2, 3, 4)  # slabs of 48, 32, 24 bytes > 16
    vec = np.arange(3, dtype=np.complex128)  # one element (16 B) > 8
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        shards = MaxShardSizePolicy(16)([_st("cube", cube)]) + MaxShardSizePolicy(8)([_st("vec", vec)])
    assert "larger than max_shard_size" in caplog.text
    items = validate_shards(shards[:-3], [_st("cube", cube)], "max")
    assert sum(len(i) for i in items) >= 2
    validate_shards(shards[-3:], [_st("vec", vec)], "max")


def test_max_shard_size_oversize_scalar_gets_own_shard_at_the_end(caplog: pytest.LogCaptureFixture) -> None:
    s = np.array(b"q" * 50, dtype=object)
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        shards = MaxShardSizePolicy(20)([_st("big_scalar", s), _st("a", np.ones(2, np.float32))])
    assert _specs(shards) == [{"a": [""]}, {"big_scalar": [""]}]
    assert "big_scalar" in caplog.text


@pytest.mark.parametrize("limit", [1, 7, 64, 100, 1000, 10**9])
def test_max_shard_size_results_always_validate_and_respect_the_limit(limit: int) -> None:
    rng = np.random.default_rng(limit)
    tensors = [_st(f"t{i}", rng.standard_normal(tuple(rng.integers(1, 9, size=rng.integers(0, 4)))).astype(np.float32))
               for i in range(12)]
    shards = MaxShardSizePolicy(limit)(tensors)
    validate_shards(shards, tensors, "max")
    for shard in shards:
        size = sum(np.asarray(v).nbytes for by_spec in shard.values() for v in by_spec.values())
        pieces = sum(len(by_spec) for by_spec in shard.values())
        assert size <= limit or pieces == 1  # only a lone piece may exceed the limit


def test_max_shard_size_keeps_offsets_of_pre_sliced_inputs() -> None:
    part = np.arange(12, dtype=np.float32).reshape(3, 4)
    st = _st("p", part, slice_spec="9 4 3,3:-")
    shards = MaxShardSizePolicy(16)([st])
    specs = [spec for shard in shards for spec in shard["p"]]
    assert specs == ["9 4 3,1:0,4", "9 4 4,1:0,4", "9 4 5,1:0,4"]
    validate_shards(shards, [st], "max")


def test_sharding_callback_is_abstract() -> None:
    with pytest.raises(TypeError):
        ShardingCallback()  # type: ignore[abstract]
    with pytest.raises(InvalidArgumentError):
        MaxShardSizePolicy(0)


# -- validation: each error has a test ---------------------------------------------

class _Fixed(ShardingCallback):
    def __init__(self, fn) -> None:
        self.fn = fn

    @property
    def description(self) -> str:
        return "test callback"

    def __call__(self, shardable_tensors):
        return self.fn(list(shardable_tensors))


def _save_with(tmp_path, fn, tensors=None):
    tensors = tensors if tensors is not None else {"a": np.arange(8, dtype=np.float32).reshape(4, 2),
                                                    "b": np.int64(5)}
    return shardckpt.save_tensors(str(tmp_path / "ck"), tensors, CheckpointOptions(sharding_callback=_Fixed(fn)))


@pytest.mark.parametrize("name,fn,fragment,key", [
    ("dropped", lambda ts: [{"a": {"": ts[0].tensor}}], "dropped", "b"),
    ("reshaped", lambda ts: [{"a": {"": ts[0].value().reshape(2, 4)}, "b": {"": ts[1].tensor}}],
     "has shape", "a"),
    ("retyped", lambda ts: [{"a": {"": ts[0].value().astype(np.float64)}, "b": {"": ts[1].tensor}}],
     "dtype changed from float32 to float64", "a"),
    ("twice", lambda ts: [{"a": {"": ts[0].tensor}}, {"a": {"": ts[0].tensor}, "b": {"": ts[1].tensor}}],
     "saved twice", "a"),
    ("overlap", lambda ts: [{"a": {"4 2 0,3:-": ts[0].value()[0:3], "4 2 2,2:-": ts[0].value()[2:4]},
                             "b": {"": ts[1].tensor}}], "overlap", "a"),
    ("gap", lambda ts: [{"a": {"4 2 0,1:-": ts[0].value()[0:1], "4 2 2,2:-": ts[0].value()[2:4]},
                         "b": {"": ts[1].tensor}}], "gap", "a"),
    ("full shape changed", lambda ts: [{"a": {"5 2 0,4:-": ts[0].value()}, "b": {"": ts[1].tensor}}],
     "full shape changed", "a"),
    ("unknown key", lambda ts: [{"a": {"": ts[0].tensor}, "b": {"": ts[1].tensor}, "zzz": {"": 1.0}}],
     "not offered", "zzz"),
    ("bad spec", lambda ts: [{"a": {"4 2 0,9:-": ts[0].value()}, "b": {"": ts[1].tensor}}],
     "does not fit", "a"),
])
def test_validation_errors_name_the_key(tmp_path, name, fn, fragment, key) -> None:
    with pytest.raises(ShardingValidationError) as info:
        _save_with(tmp_path, fn)
    message = str(info.value)
    assert fragment in message and repr(key) in message and "test callback" in message
    assert info.value.key == key
    assert not list(tmp_path.iterdir()) or not (tmp_path / "ck.index").exists()


def test_validation_rejects_shards_mixing_tasks() -> None:
    t0, t1 = _st("a", 1.0, "/job:w/task:0"), _st("b", 2.0, "/job:w/task:1")
    with pytest.raises(ShardingValidationError, match="mixes tensors of several tasks"):
        validate_shards([{"a": {"": 1.0}, "b": {"": 2.0}}], [t0, t1], "mixer")


def test_validation_rejects_malformed_results() -> None:
    t = [_st("a", 1.0)]
    with pytest.raises(ShardingValidationError, match="expected a list"):
        validate_shards({"a": {"": 1.0}}, t, "x")
    with pytest.raises(ShardingValidationError, match="expected a mapping"):
        validate_shards([["a"]], t, "x")
    with pytest.raises(ShardingValidationError, match="slice_spec: tensor"):
        validate_shards([{"a": 1.0}], t, "x")


def test_empty_shards_are_dropped(tmp_path) -> None:
    prefix = _save_with(tmp_path, lambda ts: [{}, {"a": {"": ts[0].tensor}}, {}, {"b": {"": ts[1].tensor}}])
    assert shardckpt.load_checkpoint(prefix).bundle.num_shards == 2


def test_options_reject_a_callback_that_is_not_a_sharding_callback() -> None:
    with pytest.raises(InvalidArgumentError, match="ShardingCallback"):
        CheckpointOptions(sharding_callback=lambda ts: ts)  # type: ignore[arg-type]


# -- the fields a callback written for TensorFlow reads (issue 15) ------------------------------------------


def test_shardable_tensor_fields_answer_tfs_accessors() -> None:
    st = shardckpt.ShardableTensor.from_value("w", np.zeros((3, 4), np.float32), slice_spec="6 4 3,3:-",
                                              device="/job:worker/task:2/device:GPU:1")
    assert st.shape == (3, 4) and st.shape.rank == 2 and st.shape.num_elements() == 12
    assert st.shape.as_list() == [3, 4] and st.full_shape == (6, 4)
    assert (st.device.job, st.device.replica, st.device.task) == ("worker", 0, 2)
    assert (st.device.device_type, st.device.device_index) == ("GPU", 1)
    assert st.device == "/job:worker/replica:0/task:2/device:GPU:1" == st.device.to_string()
    assert (st.dtype.name, st.dtype.size, st.dtype.as_numpy_dtype) == ("float32", 4, np.float32)
    scalar = shardckpt.ShardableTensor.from_value("s", np.array(b"x", dtype=object))
    assert scalar.shape.rank == 0 and scalar.shape.num_elements() == 1 and scalar.dtype.size == 0


def test_max_shard_size_partitioner_is_what_the_policy_runs() -> None:
    tensors = [shardckpt.ShardableTensor.from_value(f"t{i}", np.zeros((4, 4), np.float32)) for i in range(3)]
    policy = shardckpt.MaxShardSizePolicy(100)
    direct = shardckpt.MaxShardSizePolicy.MaxShardSizePartitioner().get_shards(100, tensors)
    assert [{k: sorted(v) for k, v in s.items()} for s in policy(tensors)] == \
        [{k: sorted(v) for k, v in s.items()} for s in direct]
    assert len(direct) == 2  # 3 x 64 bytes under a 100-byte limit: the second tensor is split over two shards
