"""``TensorRule`` name maps and the safetensors reader/writer under them (mmnnx.models.pretrained),
on model code the library did not write (plain ``nnx.Linear`` layers), placed and stacked."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import mmnnx as mm
from mmnnx.models.pretrained import CheckpointError, TensorRule, load_tensors, save_tensors
from mmnnx.models.pretrained.files import CheckpointFiles, write_shards
from mmnnx.models.pretrained.names import match


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 8, rngs=rngs)


class Net(nnx.Module):
    def __init__(self, rngs, depth=4):
        self.layers = nnx.List([Block(rngs) for _ in range(depth)])


class Stacked(nnx.Module):
    def __init__(self, rngs, depth=4):
        self.layers = nnx.split_rngs(splits=depth)(nnx.vmap(Block, in_axes=0))(rngs)


RULES = [
    TensorRule("h.{layer}.w", "layers/{layer}/lin/kernel", transpose=(1, 0)),
    TensorRule("h.{layer}.b", "layers/{layer}/lin/bias"),
]
STACKED = [
    TensorRule("h.{layer}.w", "layers/lin/kernel", transpose=(1, 0)),
    TensorRule("h.{layer}.b", "layers/lin/bias"),
]


def _tensors(depth=4, seed=0):
    rng = np.random.default_rng(seed)
    out = {f"h.{i}.w": rng.normal(size=(8, 4)).astype(np.float32) for i in range(depth)}
    out.update({f"h.{i}.b": rng.normal(size=(8,)).astype(np.float32) for i in range(depth)})
    return out


def _write(tmp_path, tensors, *, index=True):
    tmp_path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": {k: tensors[k] for k in names[:half]},
        "model-00002-of-00002.safetensors": {k: tensors[k] for k in names[half:]},
    }
    write_shards(tmp_path, shards)
    if index:
        weight_map = {k: f for f, group in shards.items() for k in group}
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    return tmp_path


def _tasks(n=2, axis="x"):
    per = 8 // n
    return [
        mm.Task(
            f"s{i}", mesh=mm.TaskMesh(devices=range(per * i, per * (i + 1)), axis_names=(axis,))
        )
        for i in range(n)
    ]


def test_load_places_each_variable_on_its_task_sharded_as_the_rules_say(tmp_path):
    tensors = _tensors()
    s0, s1 = _tasks()
    placement = [
        ("layers/(0|1)/lin/kernel", s0, P(None, "x")),
        ("layers/(0|1)/", s0),
        ("layers/(2|3)/", s1),
    ]
    model = load_tensors(
        lambda: Net(nnx.Rngs(0)), _write(tmp_path, tensors), RULES, rules=placement
    )
    for i in range(4):
        kernel = model.layers[i].lin.kernel[...]
        np.testing.assert_array_equal(np.asarray(kernel), tensors[f"h.{i}.w"].T)
        np.testing.assert_array_equal(
            np.asarray(model.layers[i].lin.bias[...]), tensors[f"h.{i}.b"]
        )
        assert mm.task_of(model.layers[i].lin.kernel).name == ("s0" if i < 2 else "s1")
    # the kernel's columns are split over the task's 4 devices: each shard read on its own
    shards = model.layers[0].lin.kernel[...].addressable_shards
    assert [s.data.shape for s in shards] == [(4, 2)] * 4


def test_stacked_layers_split_over_tasks_and_written_back_bit_exact(tmp_path):
    tensors = _tensors()
    model = load_tensors(
        lambda: Stacked(nnx.Rngs(0)),
        _write(tmp_path / "in", tensors),
        STACKED,
        rules=[("layers", _tasks())],
    )
    np.testing.assert_array_equal(
        np.asarray(model.layers.lin.kernel[...]),
        np.stack([tensors[f"h.{i}.w"].T for i in range(4)]),
    )
    assert mm.stack_of(model.layers.lin.kernel).name == "s0+s1"
    out = save_tensors(model, tmp_path / "out", STACKED, max_shard_bytes=200)
    files = CheckpointFiles(out)
    assert len({info.file for info in files.tensors.values()}) > 1  # several shards, one index
    for name, value in tensors.items():
        np.testing.assert_array_equal(files.read(name), value)


def test_one_file_without_an_index_and_bfloat16_tensors(tmp_path):
    tensors = {k: v.astype("bfloat16") for k, v in _tensors(2).items()}
    write_shards(tmp_path, tensors)
    model = load_tensors(lambda: Net(nnx.Rngs(0), depth=2), tmp_path, RULES)
    assert model.layers[1].lin.kernel[...].dtype == np.float32
    np.testing.assert_array_equal(
        np.asarray(model.layers[1].lin.kernel[...]), tensors["h.1.w"].T.astype(np.float32)
    )
    out = save_tensors(model, tmp_path / "bf16", RULES, dtype="bfloat16")
    again = CheckpointFiles(out)
    assert again.tensors["h.1.w"].dtype == "BF16"
    np.testing.assert_array_equal(again.read("h.1.w"), tensors["h.1.w"])  # bit-exact round trip


def test_reshape_rules_read_through_the_whole_tensor(tmp_path):
    w = np.arange(24, dtype=np.float32).reshape(6, 4)  # (heads * head_dim, in) as on disk
    write_shards(tmp_path, {"q.weight": w})

    class Heads(nnx.Module):
        def __init__(self):
            self.q = nnx.Param(np.zeros((4, 2, 3), np.float32))  # (in, heads, head_dim)

    rule = TensorRule("q.weight", "q", transpose=(1, 0), reshape=(4, 2, 3))
    model = load_tensors(Heads, tmp_path, [rule])
    np.testing.assert_array_equal(np.asarray(model.q[...]), w.T.reshape(4, 2, 3))
    with pytest.raises(CheckpointError, match="cannot write a tensor back through a reshape"):
        save_tensors(model, tmp_path / "out", [rule])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.pop("h.1.b"), r"missing tensor 'h\.1\.b' \(for Variable 'layers/1/lin/bias'"),
        (
            lambda t: t.update({"h.0.extra": np.zeros(2, np.float32)}),
            r"tensor 'h\.0\.extra' fills no",
        ),
        (lambda t: t.update({"h.4.w": np.zeros((8, 4), np.float32)}), r"tensor 'h\.4\.w' fills no"),
        (
            lambda t: t.update({"h.0.w": np.zeros((8, 5), np.float32)}),
            r"'h\.0\.w' has shape \(8, 5\)",
        ),
        (  # issue 69: was read into the float Variable, cast
            lambda t: t.update({"h.0.b": np.zeros(8, np.int64)}),
            r"tensor 'h\.0\.b' is stored as I64 \(int64\), not floating point",
        ),
    ],
)
def test_a_checkpoint_that_does_not_match_the_model_names_the_tensor(tmp_path, change, message):
    tensors = _tensors()
    change(tensors)
    _write(tmp_path, tensors)
    s0, s1 = _tasks()
    with pytest.raises(CheckpointError, match=message) as error:
        load_tensors(
            lambda: Net(nnx.Rngs(0)),
            tmp_path,
            RULES,
            rules=[("layers/(0|1)/", s0), ("layers/(2|3)/", s1)],
        )
    assert str(tmp_path) in str(error.value)


def test_missing_slot_of_a_stacked_variable_is_named(tmp_path):
    tensors = _tensors()
    del tensors["h.2.w"]
    _write(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=r"missing tensor 'h\.2\.w'.*layers/lin/kernel"):
        load_tensors(lambda: Stacked(nnx.Rngs(0)), tmp_path, STACKED)


def test_bad_directories(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        CheckpointFiles(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        CheckpointFiles(tmp_path)
    _write(tmp_path, _tensors())
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["h.9.w"] = "model-00003-of-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00003-of-00003.safetensors, which is not"):
        CheckpointFiles(tmp_path)


def test_save_refuses_an_existing_directory_and_keeps_it(tmp_path):
    model = Net(nnx.Rngs(0))
    out = save_tensors(model, tmp_path / "ckpt", RULES)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(CheckpointError, match="exists; pass overwrite=True"):
        save_tensors(Net(nnx.Rngs(1)), out, RULES)
    with pytest.raises(CheckpointError, match="no tensor rule writes Variable 'layers/0/lin/bias'"):
        save_tensors(Net(nnx.Rngs(1)), out, RULES[:1], overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    save_tensors(Net(nnx.Rngs(1)), out, RULES, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging left behind


def test_match_reports_unmatched_and_rules_check_their_fields():
    sources, unmatched = match(["h.0.w", "other"], RULES)
    assert list(sources) == ["layers/0/lin/kernel"] and unmatched == ["other"]
    with pytest.raises(ValueError, match="uses \\['expert'\\]"):
        TensorRule("h.{layer}.w", "layers/{layer}/{expert}/w")


def test_reads_only_the_slices_a_process_needs(tmp_path, monkeypatch):
    tensors = _tensors()
    _write(tmp_path, tensors)
    read = []
    original = CheckpointFiles.read

    def spy(self, name, index=(), **kwargs):
        part = original(self, name, index, **kwargs)
        read.append((name, part.size))
        return part

    monkeypatch.setattr(CheckpointFiles, "read", spy)
    s0, s1 = _tasks()
    load_tensors(
        lambda: Net(nnx.Rngs(0)),
        tmp_path,
        RULES,
        rules=[("kernel", s0, P(None, "x")), ("bias", s1, P("x"))],
    )
    # each of the 4 devices of a task reads its quarter of each tensor, once
    assert sorted({size for _, size in read}) == [2, 8]
    assert len(read) == 8 * 4
    assert jax.device_count() == 8


def test_read_equals_numpy_indexing_and_transposing_in_small_blocks(tmp_path, monkeypatch):
    import itertools

    import ml_dtypes

    from mmnnx.models.pretrained import files as files_module

    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((7, 5, 3)).astype(np.float32),
        "b": rng.standard_normal((9, 4)).astype(ml_dtypes.bfloat16),
        "c": np.arange(10, dtype=np.int64),
        "d": np.zeros((0, 3), np.float32),
    }
    write_shards(tmp_path, tensors)
    files = CheckpointFiles(tmp_path)
    monkeypatch.setattr(files_module, "BLOCK_BYTES", 13)  # a block of one or two rows
    cuts = [slice(None), slice(1, 3), slice(2, None), slice(5, 1)]
    for name, tensor in tensors.items():
        for index in [(), *itertools.product(cuts, repeat=tensor.ndim)]:
            for order in itertools.permutations(range(tensor.ndim)):
                want = tensor[index].transpose(order)
                part = files.read(name, index, transpose=order)
                assert part.dtype == want.dtype and part.shape == want.shape
                assert part.flags.c_contiguous
                np.testing.assert_array_equal(part, want, err_msg=f"{name}{index}{order}")
    with pytest.raises(IndexError, match=r"tensor 'c' \(10,\): read takes up to 1 slices"):
        files.read("c", (slice(None), slice(None)))
    with pytest.raises(ValueError, match=r"tensor 'b' \(9, 4\): transpose \(0, 0\) is not"):
        files.read("b", transpose=(0, 0))
    with pytest.raises(IndexError, match=r"tensor 'a': read takes slices of step 1"):
        files.read("a", (slice(0, None, 2),))
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-16])  # cut after opening
    with pytest.raises(CheckpointError, match=r"model.safetensors: .*incomplete metadata"):
        files.read("c")
    with pytest.raises(CheckpointError, match=r"model.safetensors: .*incomplete metadata"):
        CheckpointFiles(tmp_path)
