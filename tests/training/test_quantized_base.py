"""LoRA on a base held in 8 or 4 bits (training.quantize_base): the arithmetic against NumPy, the run against LoRA
on the dequantised weights, the planner's bytes, and the settings refused. Every layout is in test_lora_layouts.py."""

import gc
import json
import shutil

import numpy as np
import paddle
import pytest
from support.lora import logits, lora
from support.runs import ROOT, load_model

from ernie_moe import export
from ernie_moe.config import ConfigError, load_config
from ernie_moe.finetune.adapter_files import read_adapter
from ernie_moe.finetune.lora import LoRALinear, linear_layers
from ernie_moe.finetune.quantize import QuantizedLinear
from ernie_moe.memory.estimate import estimate, sample_workload
from ernie_moe.model.parameter_kinds import BASE_LINEAR
from ernie_moe.nn.quant import dequantize, quantize, unpack_int4

GROUP = 16


def numpy_quantize(w: np.ndarray, mode: str, group: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric absolute-maximum quantisation, written plainly: int8 per output column; int4 per output column
    and group of input rows (the whole column for 0), values in [-7, 7]."""
    levels = 127 if mode == "wint8" else 7
    per = group if mode == "wint4" and group else w.shape[0]
    q = np.zeros(w.shape, dtype=np.int64)
    scales = np.zeros((w.shape[0] // per, w.shape[1]), dtype=np.float32)
    for g in range(w.shape[0] // per):
        for j in range(w.shape[1]):
            block = w[g * per:(g + 1) * per, j]
            scale = np.float32(np.abs(block).max()) / np.float32(levels)
            scales[g, j] = scale
            q[g * per:(g + 1) * per, j] = np.clip(np.round(block / scale), -levels, levels) if scale > 0 else 0
    return q, scales


def numpy_pack(q: np.ndarray) -> np.ndarray:
    """Two four-bit values to a byte: row 2i in the low half, row 2i + 1 in the high half."""
    packed = np.zeros((q.shape[0] // 2, q.shape[1]), dtype=np.uint8)
    for i in range(q.shape[0] // 2):
        for j in range(q.shape[1]):
            packed[i, j] = (int(q[2 * i, j]) & 0xF) | ((int(q[2 * i + 1, j]) & 0xF) << 4)
    return packed


@pytest.mark.parametrize("mode, group", [("wint8", 0), ("wint4", 0), ("wint4", 8)])
def test_quantisation_against_numpy_within_half_a_step(mode, group):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 12)).astype(np.float32)
    w[:, 3] = 0.0  # a zero column: scale 0, dequantised to zeros
    q, scale = quantize(paddle.to_tensor(w), mode, group)
    want_q, want_scale = numpy_quantize(w, mode, group)
    np.testing.assert_allclose(scale.numpy(), want_scale, rtol=1e-7)
    if mode == "wint8":
        np.testing.assert_array_equal(q.numpy().astype(np.int64), want_q)
    else:
        np.testing.assert_array_equal(q.numpy(), numpy_pack(want_q))  # the packing, byte for byte
        np.testing.assert_array_equal(unpack_int4(q).numpy(), want_q)  # and back, exactly
    back = dequantize(q, scale, mode).numpy()
    step = np.repeat(want_scale, w.shape[0] // want_scale.shape[0], axis=0)
    assert np.all(np.abs(back - w) <= step / 2 * (1 + 1e-6) + 1e-12)
    assert np.all(back[:, 3] == 0)


def test_every_int4_value_packs_and_unpacks_exactly():
    values = np.array([[v] for v in range(-8, 8)] * 2, dtype=np.int64).reshape(-1, 1)  # every pair order
    values = np.concatenate([values, values[::-1]], axis=1)
    packed = paddle.to_tensor(numpy_pack(values))
    np.testing.assert_array_equal(unpack_int4(packed).numpy(), values)


def numpy_dequantized(layer: QuantizedLinear) -> np.ndarray:
    q = layer.quantized_weight.numpy()
    if layer.mode == "wint4":  # unpacked in NumPy, not by the function under test
        low, high = (q & 0xF).astype(np.int64), (q >> 4).astype(np.int64)
        q = np.stack([low, high], axis=1).reshape(-1, q.shape[1])
        q = np.where(q >= 8, q - 16, q)
    scale = layer.weight_scale.numpy()
    rows = q.shape[0]
    return (q.reshape(scale.shape[0], rows // scale.shape[0], -1) * scale[:, None, :]).reshape(rows, -1)


def quantized_layers(tr) -> dict:
    return {name: (layer.base if isinstance(layer, LoRALinear) else layer)
            for name, _, _, layer in linear_layers(tr.parts.model) if BASE_LINEAR.fullmatch(name)}


@pytest.mark.parametrize("mode", ["wint8", "wint4"])
def test_lora_on_a_quantised_base_is_lora_on_its_dequantised_weights(tmp_path, base, mode):
    """The same three steps: one run holds the base quantised, the other full-precision weights set to the
    dequantised values. Logits at the start, losses and trained pairs agree: only the weights' precision
    changed."""
    quantized = lora(tmp_path / "q", base, f"training.quantize_base={mode}", f"training.quantize_group_size={GROUP}")
    plain = lora(tmp_path / "d", base)
    layers = quantized_layers(quantized)
    # two layers' attention (2 each), layer 0's dense MLP (2), layer 1's shared expert (2) and 4 + 4 experts (2 each)
    assert len(layers) == 2 * 2 + 2 + 2 + 8 * 2 and all(isinstance(x, QuantizedLinear) for x in layers.values())
    names = {n for n, _ in quantized.parts.model.stable_named_parameters()}
    assert not any(f"{n}.weight" in names for n in layers)  # no full-precision copy of the base is held
    targets = {name: layer.weight for name, layer in quantized_layers(plain).items()}
    assert set(targets) == set(layers)
    for name, layer in layers.items():
        targets[name].set_value(paddle.to_tensor(numpy_dequantized(layer).astype(np.float32)))
    batch = quantized.next_micro_batches()[0]
    assert plain.next_micro_batches()[0].input_ids.numpy().tolist() == batch.input_ids.numpy().tolist()
    np.testing.assert_allclose(logits(quantized, batch), logits(plain, batch), rtol=1e-5, atol=1e-5)
    losses = []
    for tr in (quantized, plain):
        run = []
        for tr.step in range(1, 4):
            result = tr.train_step().read()
            run.append(result.lm_loss_sum / result.label_tokens)
        losses.append(run)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    pairs = [{n: p.numpy() for n, p in tr.parts.model.stable_named_parameters() if not p.stop_gradient}
             for tr in (quantized, plain)]
    assert set(pairs[0]) == set(pairs[1]) and any(np.abs(v).max() > 0 for n, v in pairs[0].items()
                                                  if n.endswith(".lora_B"))
    for name in pairs[0]:
        np.testing.assert_allclose(pairs[0][name], pairs[1][name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("mode, group", [("wint8", 0), ("wint4", 0), ("wint4", GROUP)])
def test_the_planner_counts_the_quantised_bytes(tmp_path, base, mode, group):
    """What the allocator holds once the run is built (the full-precision base it loaded freed again) against the
    planner's parameter bytes: within 2%, and below the full-precision model's."""
    gc.collect()
    before = paddle.base.core.host_memory_stat_current_value("Allocated", 0)
    tr = lora(tmp_path / "run", base, f"training.quantize_base={mode}", f"training.quantize_group_size={group}")
    gc.collect()
    allocated = paddle.base.core.host_memory_stat_current_value("Allocated", 0) - before
    held = sum(t.size * t.element_size() for t in [*tr.parts.model.parameters(), *tr.parts.model.buffers()])
    predicted = estimate(tr.cfg, sample_workload(tr.cfg, 1), 1)[0].parameters
    assert abs(predicted / allocated - 1) <= 0.02 and abs(predicted / held - 1) <= 0.02, (predicted, allocated, held)
    full = lora(tmp_path / "full", base)
    assert held < sum(p.size * p.element_size() for p in full.parts.model.parameters())


def test_bad_quantisation_settings_are_one_line_config_errors(tmp_path, base):
    config = str(ROOT / "configs" / "vl_moe.yaml")
    with pytest.raises(ConfigError, match="needs training.fine_tuning: lora"):
        load_config(config, ["training.quantize_base=wint8"])
    with pytest.raises(ConfigError, match="even number"):
        load_config(config, ["training.fine_tuning=lora", "training.quantize_base=wint4",
                             "training.quantize_group_size=7"])
    with pytest.raises(ConfigError, match="does not divide the 32 input rows"):  # the vision experts' down_proj
        lora(tmp_path / "groups", base, "training.quantize_base=wint4", "training.quantize_group_size=64")
    quantized = tmp_path / "quantized_base"
    shutil.copytree(base, quantized)
    saved = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**saved, "quantization_config": {"weight_quantize_algo":
                                                                                          "weight_only_int8"}}))
    with pytest.raises(ConfigError, match="holds a quantised model"):
        lora(tmp_path / "again", quantized, "training.quantize_base=wint8")


def test_the_adapter_of_a_quantised_run_merges_into_the_full_precision_base(tmp_path, base):
    """The run saves the pairs and the base's digest only; ``export --merge-lora`` adds them to the base read
    from its folder in full precision, never to the dequantised weights."""
    tr = lora(tmp_path / "run", base, "training.quantize_base=wint4")
    for tr.step in range(1, 3):
        tr.train_step()
    tr._finish({})
    adapter = tmp_path / "run" / "final_model"
    assert json.loads((adapter / "base_model.json").read_text())["path"] == str(base.resolve())
    assert export.main([str(adapter), str(tmp_path / "merged"), "--merge-lora"]) == 0
    before, after = load_model(base), load_model(tmp_path / "merged")
    _, pairs = read_adapter(adapter)
    down = "model.layers.0.mlp.down_proj"
    scaling = json.loads((adapter / "lora_config.json").read_text())["scaling"]
    expected = before[f"{down}.weight"] + (pairs[f"{down}.lora_A"] @ pairs[f"{down}.lora_B"] * scaling).T
    np.testing.assert_allclose(after[f"{down}.weight"], expected, rtol=1e-6, atol=1e-7)
    dequantized = numpy_dequantized(quantized_layers(tr)[down]).T  # [out, in] as the folder holds it
    assert not np.allclose(after[f"{down}.weight"], dequantized + (expected - before[f"{down}.weight"]), atol=1e-7)
