"""``shardckpt.jax``: pytrees of sharded jax.Arrays, in one process with 8 CPU devices.

The multi-process tests (real processes over ``jax.distributed.initialize`` on
loopback) are in tests/test_jax_multiprocess.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from pathlib import Path  # noqa: E402
from typing import Any, Dict  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import shardckpt  # noqa: E402
import shardckpt.jax as sj  # noqa: E402
from shardckpt import dtensor as dt  # noqa: E402
from shardckpt.cli.main import main as cli_main  # noqa: E402
from shardckpt.errors import InvalidArgumentError, NotFoundError  # noqa: E402
from shardckpt.format.bundle_reader import BundleReader  # noqa: E402
from shardckpt.storage.local import LocalFileSystem  # noqa: E402
from shardckpt.storage.location import Location

jax.config.update("jax_enable_x64", True)  # float64/int64 leaves stay 64-bit
if len(jax.devices()) < 8:  # pragma: no cover - jax imported earlier in the session without the flag
    raise RuntimeError("tests/test_jax.py needs 8 CPU devices: run it with "
                       "XLA_FLAGS=--xla_force_host_platform_device_count=8 or in its own pytest process")


def mesh(shape, names) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def put(value: np.ndarray, sharding: Any) -> jax.Array:
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def model_state(seed: int = 0) -> Dict[str, Any]:
    """Params on a (2, 4) mesh with several PartitionSpecs, and optax Adam state with the same shardings."""
    m = mesh((2, 4), ("x", "y"))
    rng = np.random.default_rng(seed)
    specs = {"dense/kernel": P("x", "y"), "dense/bias": P("y"), "embed": P(None, "x"), "head": P(("x", "y")),
             "norm": P()}
    shapes = {"dense/kernel": (16, 32), "dense/bias": (32,), "embed": (24, 8), "head": (64, 4), "norm": (8,)}
    params: Dict[str, Any] = {"dense": {}}
    for name, spec in specs.items():
        value = rng.standard_normal(shapes[name]).astype(np.float32)
        array = put(value, NamedSharding(m, spec))
        if "/" in name:
            params["dense"][name.split("/")[1]] = array
        else:
            params[name] = array
    opt_state = optax.adam(1e-3).init(params)
    # give the moments values of their own (init makes zeros), keeping the params' shardings
    opt_state = jax.tree.map(lambda x: x + 0.5 if isinstance(x, jax.Array) and x.ndim else x, opt_state)
    return {"params": params, "opt_state": opt_state, "step": 7}


def as_target(tree: Any, sharding_for) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_for(x))
                        if isinstance(x, jax.Array) else x, tree)


def assert_same(restored: Any, expected: Any, target: Any) -> None:
    """Same structure, bit-exact values, and every array with exactly the target's sharding."""
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for got, want, tgt in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), jax.tree.leaves(target)):
        if isinstance(want, jax.Array):
            assert isinstance(got, jax.Array)
            assert got.sharding == tgt.sharding
            assert got.dtype == want.dtype and got.shape == want.shape
            assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
        else:
            assert type(got) is type(want) and got == want


LAYOUTS = {
    "(4,2) transposed": lambda x: NamedSharding(mesh((4, 2), ("a", "b")), P(*(["b", "a"][: x.ndim]))),
    "(8,) first dim": lambda x: NamedSharding(mesh((8,), ("d",)), P("d") if x.ndim and x.shape[0] % 8 == 0 else P()),
    "single device": lambda x: SingleDeviceSharding(jax.devices()[5]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_state_restores_bit_exact_onto_other_meshes_and_specs(tmp_path: Path, layout: str) -> None:
    state = model_state()
    prefix = sj.save(tmp_path / "ck", state)
    target = as_target(state, LAYOUTS[layout])
    assert_same(sj.restore(prefix, target), state, target)
    assert_same(sj.restore(prefix, target, memory_budget=1, max_workers=1), state, target)  # one leaf at a time


def test_keys_are_readable_paths_and_each_piece_is_written_once(tmp_path: Path) -> None:
    state = model_state()
    prefix = sj.save(tmp_path / "ck", state)
    with BundleReader(Location.of(prefix)) as reader:
        keys = {k.decode() for k in reader.keys()}
        assert {"params/dense/kernel", "params/dense/bias", "params/embed", "params/head", "params/norm",
                "opt_state/0/mu/dense/kernel", "opt_state/0/nu/norm",
                "opt_state/0/count", "step", sj.METADATA_KEY} <= keys
        # kernel on P("x","y") over (2,4): 8 distinct pieces; norm replicated: one whole entry
        assert len(reader.pieces("params/dense/kernel")) == 8
        assert len(reader.pieces("params/norm")) == 1
        assert len(reader.pieces("params/embed")) == 2  # P(None, "x"): two pieces, each replicated 4 times
    assert len(list(tmp_path.glob("ck.data-*"))) == 8  # one shard per device


DTYPES = ["bfloat16", "float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "uint32",
          "bool", "complex64", "float8_e4m3fn", "float8_e5m2", "int4", "uint4"]


@pytest.mark.parametrize("name", DTYPES)
def test_dtypes_round_trip_bit_exact(tmp_path: Path, name: str) -> None:
    dtype = np.dtype(getattr(ml_dtypes, name, None) or name)
    rng = np.random.default_rng(3)
    if name in ("int4", "uint4"):
        value = rng.integers(-8 if name == "int4" else 0, 8, (8, 12)).astype(dtype)
    elif dtype == np.bool_:
        value = rng.integers(0, 2, (8, 12)).astype(bool)
    else:
        value = np.frombuffer(rng.bytes(96 * dtype.itemsize), dtype=dtype).reshape(8, 12).copy()
    saved = put(value, NamedSharding(mesh((2, 4), ("x", "y")), P("x", "y")))
    prefix = sj.save(tmp_path / "ck", {"w": saved})
    target = {"w": jax.ShapeDtypeStruct((8, 12), dtype, sharding=NamedSharding(mesh((8,), ("d",)), P("d")))}
    got = sj.restore(prefix, target)["w"]
    assert got.dtype == dtype and got.sharding == target["w"].sharding
    assert np.asarray(got).tobytes() == value.tobytes()


def test_non_array_leaves_none_and_empty_containers_round_trip(tmp_path: Path) -> None:
    a = put(np.arange(16, dtype=np.int32).reshape(4, 4), NamedSharding(mesh((2, 4), ("x", "y")), P("x")))
    tree = {"a": a, "n": 3, "big": -(2**62), "f": 0.25, "flag": True, "s": "héllo/wörld", "b": b"\x00\xff",
            "none": None, "empty": {}, "elist": [], "nested": [1, (2.5, None, "x"), {"k": np.arange(3)}]}
    prefix = sj.save(tmp_path / "ck", tree)
    got = sj.restore(prefix, tree)
    assert np.array_equal(np.asarray(got["a"]), np.asarray(a)) and got["a"].sharding == a.sharding
    for key in ("n", "big", "f", "flag", "s", "b"):
        assert type(got[key]) is type(tree[key]) and got[key] == tree[key]
    assert got["none"] is None and got["empty"] == {} and got["elist"] == []
    assert got["nested"][:2] == [1, (2.5, None, "x")] and np.array_equal(got["nested"][2]["k"], np.arange(3))
    # without a target: the saved structure, arrays as NumPy
    plain = sj.restore(prefix)
    assert jax.tree.structure(plain) == jax.tree.structure(tree)
    assert np.array_equal(plain["a"], np.asarray(a)) and plain["s"] == "héllo/wörld" and plain["flag"] is True


def test_partial_restore_of_a_sub_tree_and_through_a_key_map(tmp_path: Path) -> None:
    state = model_state()
    prefix = sj.save(tmp_path / "ck", state)
    sharding = NamedSharding(mesh((8,), ("d",)), P())
    target = {"params": as_target(state["params"], lambda x: sharding)}
    got = sj.restore(prefix, target)
    assert set(got) == {"params"}
    assert_same(got, {"params": state["params"]}, target)
    # the params alone as the target's root, found under params/ through a key map
    got = sj.restore(prefix, target["params"], key_map=lambda k: "params/" + k)
    assert_same(got, state["params"], target["params"])


def test_mismatches_and_missing_keys_are_named_before_anything_is_read(tmp_path: Path) -> None:
    state = model_state()
    prefix = sj.save(tmp_path / "ck", state)
    s = SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(InvalidArgumentError, match="params/norm.*dtype mismatch"):
        sj.restore(prefix, {"params": {"norm": jax.ShapeDtypeStruct((8,), jnp.bfloat16, sharding=s)}})
    with pytest.raises(InvalidArgumentError, match="params/norm.*shape mismatch"):
        sj.restore(prefix, {"params": {"norm": jax.ShapeDtypeStruct((9,), jnp.float32, sharding=s)}})
    with pytest.raises(NotFoundError, match="params/nope"):
        sj.restore(prefix, {"params": {"nope": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=s)}})
    with pytest.raises(InvalidArgumentError, match="bad.*cannot save a leaf of type object"):
        sj.save(tmp_path / "bad", {"bad": object()})
    assert not list(tmp_path.glob("bad*"))


@pytest.fixture
def bytes_read(monkeypatch) -> Dict[str, int]:
    """Counts the bytes every ``LocalFileSystem.pread_into`` reads (the data files; the index uses read_bytes)."""
    counter = {"bytes": 0}
    original = LocalFileSystem.pread_into

    def counting(self, fd, buf, offset, path=""):
        counter["bytes"] += memoryview(buf).nbytes
        return original(self, fd, buf, offset, path)

    monkeypatch.setattr(LocalFileSystem, "pread_into", counting)
    return counter


@pytest.mark.parametrize("layout", ["(4,2) transposed", "(8,) first dim", "single device"])
def test_resharded_restore_reads_only_the_needed_bytes(tmp_path: Path, bytes_read: Dict[str, int],
                                                       layout: str) -> None:
    m = mesh((2, 4), ("x", "y"))
    rng = np.random.default_rng(5)
    big = {"k": put(rng.standard_normal((256, 512)).astype(np.float32), NamedSharding(m, P("x", "y"))),
           "e": put(rng.standard_normal((512, 256)).astype(np.float32), NamedSharding(m, P(None, "y")))}
    prefix = sj.save(tmp_path / "ck", big)
    target = as_target(big, LAYOUTS[layout])
    need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(target))  # one process: each byte once
    bytes_read["bytes"] = 0
    got = sj.restore(prefix, target)
    assert need <= bytes_read["bytes"] <= 1.1 * need, (bytes_read["bytes"], need)
    assert_same(got, big, target)


def test_a_partial_restore_reads_only_the_sub_trees_bytes(tmp_path: Path, bytes_read: Dict[str, int]) -> None:
    rng = np.random.default_rng(6)
    m = mesh((2, 4), ("x", "y"))
    tree = {name: put(rng.standard_normal((256, 512)).astype(np.float32), NamedSharding(m, P("x", "y")))
            for name in ("a", "b", "c", "d")}
    prefix = sj.save(tmp_path / "ck", tree)
    target = {"c": jax.ShapeDtypeStruct((256, 512), np.float32, sharding=NamedSharding(m, P("y", "x")))}
    bytes_read["bytes"] = 0
    got = sj.restore(prefix, target)
    need = 256 * 512 * 4
    assert need <= bytes_read["bytes"] <= 1.1 * need
    assert np.array_equal(np.asarray(got["c"]), np.asarray(tree["c"])) and got["c"].sharding == target["c"].sharding


def test_tensorflow_reads_the_checkpoint_and_verify_passes(tmp_path: Path, tf_oracle, capsys) -> None:
    state = model_state()
    state["params"]["bf16"] = put(np.arange(32, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(4, 8),
                                  NamedSharding(mesh((2, 4), ("x", "y")), P("x", "y")))
    prefix = sj.save(tmp_path / "ck", state)
    tensors, errors, _ = tf_oracle.load_checkpoint(prefix)
    assert not errors
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        key = sj.key_of(path)
        want = np.asarray(leaf)
        assert tensors[key].dtype == want.dtype and tensors[key].tobytes() == want.tobytes(), key
    assert cli_main(["verify", prefix]) == 0
    assert capsys.readouterr().out.startswith("OK: ")


def test_restores_checkpoints_written_by_tensorflow_checkpoint_and_dtensor(tmp_path: Path, tf_oracle) -> None:
    rng = np.random.default_rng(8)
    kernel = rng.standard_normal((8, 16)).astype(np.float32)
    target_sharding = NamedSharding(mesh((4, 2), ("a", "b")), P("b", "a"))
    target = {"dense": {"kernel": jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=target_sharding)}}
    # TensorFlow (SaveV2, in two slices), through a key map
    tf_oracle.save_v2(tmp_path / "tf", ["model/w", "model/w"], ["8 16 0,4:-", "8 16 4,4:-"],
                      [kernel[:4], kernel[4:]])
    got = sj.restore(tmp_path / "tf", target, key_map={"dense/kernel": "model/w"})["dense"]["kernel"]
    assert got.sharding == target_sharding and np.array_equal(np.asarray(got), kernel)
    # shardckpt.Checkpoint: object-graph keys (<path>/.ATTRIBUTES/VARIABLE_VALUE) are found by path
    ckpt = shardckpt.Checkpoint(dense=shardckpt.Module())
    ckpt.dense.kernel = shardckpt.Variable(kernel)
    path = ckpt.write(str(tmp_path / "obj"))
    got = sj.restore(path, target)["dense"]["kernel"]
    assert got.sharding == target_sharding and np.array_equal(np.asarray(got), kernel)
    # DTensorCheckpoint on a (2, 4) mesh, sharded
    dmesh = dt.create_mesh([("x", 2), ("y", 4)])
    var = dt.DVariable.from_global(kernel, dt.Layout(["x", "y"], dmesh), name="kernel")
    dpath = dt.DTensorCheckpoint(dmesh, kernel=var).save(str(tmp_path / "dt"))
    got = sj.restore(dpath, {"kernel": target["dense"]["kernel"]})["kernel"]
    assert got.sharding == target_sharding and np.array_equal(np.asarray(got), kernel)


def test_side_by_side_with_orbax(tmp_path: Path) -> None:
    """Orbax's StandardCheckpointer and shardckpt restore the same state onto the same target identically."""
    import orbax.checkpoint as ocp  # in the test extra; missing is a failure, never a skip

    state = model_state()
    arrays = {"params": state["params"], "opt_state": state["opt_state"]}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax", arrays)
        checkpointer.wait_until_finished()
        target = as_target(arrays, LAYOUTS["(4,2) transposed"])
        theirs = checkpointer.restore(tmp_path / "orbax", target)
    ours = sj.restore(sj.save(tmp_path / "ck", arrays), target)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        if isinstance(b, jax.Array):
            assert a.sharding == b.sharding
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_async_save_returns_before_the_commit_and_survives_deleted_arrays(tmp_path: Path) -> None:
    state = model_state()
    expected = jax.tree.map(lambda x: np.asarray(x).copy() if isinstance(x, jax.Array) else x, state)
    prefix = sj.save(tmp_path / "ck", state, options=shardckpt.CheckpointOptions(enable_async=True))
    for leaf in jax.tree.leaves(state):  # as a donated buffer would be
        if isinstance(leaf, jax.Array):
            leaf.delete()
    sj.wait_until_finished()
    got = sj.restore(prefix)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        assert np.array_equal(a, b)


def test_async_save_stays_correct_when_the_arrays_are_donated(tmp_path: Path) -> None:
    """A jit with ``donate_argnums`` right after an async save overwrites nothing the save still writes;
    once committed, the save holds no reference and the next donation reuses the buffers."""
    from shardckpt.saving.context import default_context

    state = model_state()
    expected = jax.tree.map(lambda x: np.asarray(x).copy() if isinstance(x, jax.Array) else x, state)
    arrays = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
    step = jax.jit(lambda xs: [x.at[...].set(-1) for x in xs], donate_argnums=0)
    prefix = sj.save(tmp_path / "ck", state, options=shardckpt.CheckpointOptions(enable_async=True))
    # CPU shards are held, not copied: the staging pool holds a buffer only for the host leaf (step, int64)
    assert default_context().saver().pool.nbytes == 8
    stepped = jax.block_until_ready(step(arrays))
    assert all(np.all(np.asarray(x) == -1) for x in stepped)
    sj.wait_until_finished()
    got = sj.restore(prefix)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        assert np.array_equal(a, b)
    pointers = [s.data.unsafe_buffer_pointer() for x in stepped for s in x.addressable_shards]
    again = jax.block_until_ready(step(stepped))  # nothing holds the bytes any more: donated in place
    assert all(x.is_deleted() for x in stepped)
    assert [s.data.unsafe_buffer_pointer() for x in again for s in x.addressable_shards] == pointers


def test_checkpoint_manager_keeps_the_newest_and_restores_the_latest(tmp_path: Path) -> None:
    state = model_state()
    ckpt = sj.PyTreeCheckpoint(state)
    manager = shardckpt.CheckpointManager(ckpt, str(tmp_path), max_to_keep=2)
    for step in range(1, 4):
        ckpt.state = dict(ckpt.state, step=step)
        options = shardckpt.CheckpointOptions(enable_async=step == 3)
        assert manager.save(options=options) == str(tmp_path / f"ckpt-{step}")
    manager.sync()
    assert manager.latest_checkpoint == str(tmp_path / "ckpt-3")
    assert sorted(p.name for p in tmp_path.glob("*.index")) == ["ckpt-2.index", "ckpt-3.index"]
    assert shardckpt.latest_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt-3")
    # a fresh process: a target on another mesh, restore_or_initialize
    fresh = sj.PyTreeCheckpoint(dict(as_target(state, LAYOUTS["(8,) first dim"]), step=0))
    again = shardckpt.CheckpointManager(fresh, str(tmp_path), max_to_keep=2)
    assert again.restore_or_initialize() == str(tmp_path / "ckpt-3")
    assert fresh.state["step"] == 3 and int(fresh.save_counter.array) == 3
    assert_same(fresh.state, dict(state, step=3), dict(as_target(state, LAYOUTS["(8,) first dim"]), step=0))
    assert again.save() == str(tmp_path / "ckpt-4")


def test_a_fully_replicated_restore_shares_one_host_buffer_on_cpu(tmp_path: Path) -> None:
    """A leaf replicated on 8 CPU devices is read once into a 64-byte aligned array that every device's
    buffer shares (JAX copies host arrays of lesser alignment: eight copies of every leaf). Leaves of a
    page or more: smaller ones are NumPy's arrays as they come (copies cost less than aligning)."""
    rng = np.random.default_rng(3)
    value = rng.standard_normal((256, 64)).astype(np.float32)
    replicated = NamedSharding(mesh((8,), ("d",)), P())
    prefix = sj.save(tmp_path / "ck", {"w": put(value, replicated), "b": put(value[:, :5].copy(), replicated)})
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated)
              for k, v in {"w": value, "b": value[:, :5]}.items()}
    for _ in range(3):  # (with NumPy's 16-byte alignment a leaf is shared by luck, one time in four)
        got = sj.restore(prefix, target)
        assert np.asarray(got["w"]).tobytes() == value.tobytes()
        assert np.asarray(got["b"]).tobytes() == value[:, :5].tobytes()
        for leaf in got.values():
            pointers = {shard.data.unsafe_buffer_pointer() for shard in leaf.addressable_shards}
            assert len(leaf.addressable_shards) == 8 and len(pointers) == 1, pointers


def test_tiered_checkpoints_of_a_pytree_save_each_piece_once_and_restore_onto_any_layout(tmp_path: Path) -> None:
    """``CheckpointManager(PyTreeCheckpoint(state), ..., local=LocalTier(...))``: every save into the node's tier,
    every fifth also persistent; the tier bundle holds each distinct region once (a replicated array whole)
    and the pytree's metadata; restores come from the tier, onto the saved layout or another one."""
    state = model_state()
    tier = shardckpt.LocalTier(str(tmp_path / "tier" / "{node}"), keep=2)
    ckpt = sj.PyTreeCheckpoint(state)
    manager = shardckpt.CheckpointManager(ckpt, str(tmp_path / "persistent"), max_to_keep=2, local=tier,
                                          persist_every=5)
    for step in range(1, 7):
        ckpt.state = dict(state, step=step)
        manager.save(options=shardckpt.CheckpointOptions(enable_async=step == 3))
    manager.sync()
    assert shardckpt.latest_checkpoint(str(tmp_path / "persistent")) == str(tmp_path / "persistent" / "ckpt-5")
    (bundle,) = (tmp_path / "tier").glob("*/node-*/ckpt-6.index")
    with BundleReader(Location.of(str(bundle)[: -len(".index")])) as reader:
        assert len(reader.pieces("params/dense/kernel")) == 8  # P("x", "y") on (2, 4): 8 distinct regions
        assert len(reader.pieces("params/embed")) == 2  # P(None, "x"): 2 regions, each on 4 devices, once
        assert len(reader.pieces("params/norm")) == 1  # replicated: whole, once
        assert reader.read("step") == 6
    assert cli_main(["verify", str(bundle.parent.parent)]) == 0  # the node's tier folder
    for layout in ("(2,4) as saved", "(8,) first dim", "single device"):
        shardings = LAYOUTS.get(layout, lambda x: x.sharding)
        target = dict(as_target(state, shardings), step=0)
        fresh = sj.PyTreeCheckpoint(target)
        again = shardckpt.CheckpointManager(fresh, str(tmp_path / "persistent"), max_to_keep=2, local=tier,
                                            persist_every=5)
        again.restore_or_initialize()
        assert again.local.last_restore.step == 6, (layout, again.local.last_restore)
        assert fresh.state["step"] == 6 and int(fresh.save_counter.array) == 6
        assert_same(fresh.state, dict(state, step=6), target)
