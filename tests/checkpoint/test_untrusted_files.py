"""Files a run reads that were crafted or damaged: a pickle payload in a .pdparams, a model folder's JSON of the
wrong shape or depth, a chat template too large; none runs code, each is refused in one line."""

import json
import os
import pickle
import random
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from support.runs import ROOT, losses, train


class TouchesAFile:
    """A pickle payload: unpickling it would create ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


# ---------------------------------------------------------------------------------------- loading runs no code

@pytest.mark.slow
def test_a_crafted_pdparams_is_refused_and_never_executed(tmp_path):
    touched = tmp_path / "pwned"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "ernie4_5", "hidden_size": 64, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "vocab_size": 128,
                                                   "intermediate_size": 128}))
    (model / "model_state.pdparams").write_bytes(pickle.dumps({"model.embed_tokens.weight": TouchesAFile(touched)}))

    exported = subprocess.run([sys.executable, "-m", "ernie_moe.export", str(model), str(tmp_path / "out")],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert exported.returncode == 2, exported.stderr[-2000:]
    assert "refusing to read" in exported.stderr and "model_state.pdparams" in exported.stderr
    assert "posix.system" in exported.stderr and "Traceback" not in exported.stderr

    trained = train(tmp_path / "run", f"training.model_name_or_path={model}", "model.moe_num_experts=[]",
                    "model.moe_intermediate_size=[]", check=False)
    assert trained.returncode == 2 and "refusing to read" in trained.stderr, trained.stderr[-2000:]
    assert not touched.exists()


@pytest.mark.parametrize("protocol", [2, 3, 4])
def test_a_real_pdparams_reads_as_paddle_load_reads_it(tmp_path, protocol):
    """Every pickle protocol ``paddle.save`` writes; its bookkeeping entry and a bare tensor's (name, array) pair
    are read past, bfloat16 is widened."""
    import paddle

    from ernie_moe.checkpoint.pdparams import load_pdparams

    state = {"w": paddle.randn([3, 4]), "half": paddle.randn([5]).astype("float16"),
             "bf16": paddle.randn([2, 3]).astype("bfloat16"), "ids": paddle.to_tensor([[1, -2]], dtype="int64"),
             "mask": paddle.to_tensor([True, False]), "empty": paddle.zeros([0, 4])}
    paddle.save(state, str(tmp_path / "model_state.pdparams"), protocol=protocol)
    loaded = load_pdparams(tmp_path / "model_state.pdparams")
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        expected = tensor.astype("float32") if tensor.dtype == paddle.bfloat16 else tensor
        np.testing.assert_array_equal(loaded[name], expected.numpy(), err_msg=name)
        assert loaded[name].dtype == expected.numpy().dtype, name
    reference = paddle.load(str(tmp_path / "model_state.pdparams"))  # the test's own file: paddle.load may read it
    np.testing.assert_array_equal(loaded["w"], reference["w"].numpy())


class Stateful:
    def __init__(self):
        self.touched = True


@pytest.mark.parametrize("payload, why", [
    ({"w": TouchesAFile("/nonexistent/pwned")}, "it names posix.system"),
    ({"w": np.array([TouchesAFile("/nonexistent/pwned")], dtype=object)}, "dtype object"),
    ({"w": np.array([1, 2], dtype=object)}, "dtype object"),
    ({"w": np.zeros(2, dtype=[("a", "f4"), ("b", "i4")])}, "structured dtype"),
    ({"w": np.array(["text"])}, "dtype <U4"),
    ({"w": {1, 2}}, "opcode"),
    ({"w": Stateful()}, "it names test_untrusted_files.Stateful"),
    (b"not a pickle", "opcode"),
    ([np.ones(2)], "it holds a list, not a state dict"),
], ids=["call", "objects calling", "objects", "records", "strings", "set", "instance", "garbage", "list"])
def test_a_pdparams_of_anything_but_plain_arrays_is_refused_by_name(tmp_path, payload, why):
    from ernie_moe.checkpoint.errors import CheckpointError
    from ernie_moe.checkpoint.pdparams import load_pdparams

    path = tmp_path / "model_state.pdparams"
    path.write_bytes(payload if isinstance(payload, bytes) else pickle.dumps(payload, protocol=4))
    with pytest.raises(CheckpointError, match="refusing to read .*model_state.pdparams: ") as refused:
        load_pdparams(path)
    assert why in str(refused.value)


def test_a_cut_or_altered_pdparams_is_refused(tmp_path):
    """Cut anywhere, or with an array's length byte changed, a real file is an error, never a wrong tensor."""
    from ernie_moe.checkpoint.errors import CheckpointError
    from ernie_moe.checkpoint.pdparams import load_pdparams

    data = pickle.dumps({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, protocol=4)
    path = tmp_path / "model_state.pdparams"
    refused = 0
    for end in range(len(data)):
        path.write_bytes(data[:end])
        with pytest.raises(CheckpointError, match="refusing to read"):
            load_pdparams(path)
        refused += 1
    assert refused == len(data)
    raw = np.arange(6, dtype=np.float32).tobytes()
    at = data.index(raw)
    assert data[at - 1] == len(raw)  # SHORT_BINBYTES' length byte
    path.write_bytes(data[:at - 1] + bytes([len(raw) - 4]) + data[at:at + len(raw) - 4] + data[at + len(raw):])
    with pytest.raises(CheckpointError, match="an array of shape .2, 3. and dtype float32 holds 20 bytes"):
        load_pdparams(path)
    code = b"\x8c\x02f4"  # the dtype's type code, which NumPy would parse as an expression if it were one
    assert data.count(code) == 1
    path.write_bytes(data.replace(code, b"\x8c\x04f4,("))
    with pytest.raises(CheckpointError, match="it holds a dtype written 'f4,\\(', not a type code"):
        load_pdparams(path)


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_pdparams_with_bytes_changed_anywhere_is_read_or_refused(tmp_path, protocol):
    """A real file with one to four bytes changed, cut out or slipped in, 2,000 times (a fixed seed): each reads
    as a state dict of arrays or is refused with a CheckpointError; no other error escapes the reader."""
    import paddle

    from ernie_moe.checkpoint.errors import CheckpointError
    from ernie_moe.checkpoint.pdparams import load_pdparams

    path = tmp_path / "model_state.pdparams"
    state = {"w": paddle.randn([3, 4]), "ids": paddle.zeros([2], dtype="int64"),
             "bf16": paddle.randn([2, 2]).astype("bfloat16"), "empty": paddle.zeros([0, 3])}
    paddle.save(state, str(path), protocol=protocol)
    data = path.read_bytes()
    rng = random.Random(protocol)
    outcomes = Counter()
    for _ in range(2000):
        changed = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            at, how = rng.randrange(len(changed)), rng.random()
            if how < 0.6:
                changed[at] = rng.randrange(256)
            elif how < 0.8:
                del changed[at:at + rng.randint(1, 8)]
            else:
                changed[at:at] = rng.randbytes(rng.randint(1, 8))
        path.write_bytes(bytes(changed))
        try:
            loaded = load_pdparams(path)
        except CheckpointError:
            outcomes["refused"] += 1
        else:
            assert all(isinstance(value, np.ndarray) for value in loaded.values())
            outcomes["read"] += 1
    assert outcomes["refused"] + outcomes["read"] == 2000 and outcomes["refused"] > 1000, outcomes


@pytest.mark.parametrize("config, index, why", [
    ([{"model_type": "ernie4_5_moe_vl"}], None, "config.json holds a JSON list, not an object"),
    ({"model_type": "ernie4_5_moe_vl"}, [1], "cannot read .*model.safetensors.index.json: list indices"),
    ({"model_type": "ernie4_5_moe_vl"}, {"weight_map": ["a"]}, "weight_map must map each tensor name to a file"),
    ({"model_type": "ernie4_5_moe_vl"}, {"weight_map": {"w": 3}}, "weight_map must map each tensor name to a file"),
], ids=["config list", "index list", "map list", "file number"])
def test_a_model_folder_with_json_of_the_wrong_shape_is_refused(tmp_path, config, index, why):
    from ernie_moe.checkpoint.errors import CheckpointError
    from ernie_moe.checkpoint.formats import SourceCheckpoint

    (tmp_path / "config.json").write_text(json.dumps(config))
    if index is not None:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=why):
        SourceCheckpoint(tmp_path)


def test_no_module_of_the_package_imports_pickle():
    for module in (ROOT / "ernie_moe").rglob("*.py"):
        source = module.read_text()
        assert "import pickle" not in source and "from pickle" not in source, module


@pytest.mark.slow
def test_checkpoints_keep_random_states_as_json_and_never_unpickle(tmp_path):
    out = tmp_path / "run"
    train(out, "training.max_steps=2", "training.save_steps=1")
    checkpoint = out / "checkpoint-1"
    state = json.loads((checkpoint / "rng_state-00000.json").read_text())
    assert set(state) == {"python", "numpy", "paddle"}
    touched = tmp_path / "pwned"
    (checkpoint / "rng_state-00000.pkl").write_bytes(pickle.dumps(TouchesAFile(touched)))  # the old file name
    train(tmp_path / "resumed", "training.max_steps=2", f"training.resume_from_checkpoint={checkpoint}")
    assert not touched.exists()
    assert losses(tmp_path / "resumed") == {2: losses(out)[2]}
