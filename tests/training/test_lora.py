"""LoRA and partial fine-tuning in one process: the formula, what trains, what is saved, merged and refused."""

import json
import subprocess
import sys

import numpy as np
import paddle
import pytest
from paddle import nn
from safetensors.numpy import load_file, save_file
from support.lora import logits, lora, trainer
from support.runs import ROOT

from ernie_moe.checkpoint.errors import CheckpointError
from ernie_moe.config import ConfigError, load_config
from ernie_moe.config.schema import FREEZE_PARTS, LORA_TARGET_GROUPS
from ernie_moe.finetune import learning_rate_ratios
from ernie_moe.finetune.adapter_files import load_adapter, merged_weight, read_adapter, target_patterns
from ernie_moe.finetune.lora import LoRALinear, LoRASettings, is_lora
from ernie_moe.generation.model_folder import load_model_folder
from ernie_moe.model.parameter_kinds import LORA_TARGETS, PARTS


def test_the_names_the_config_accepts_are_the_ones_finetune_knows():
    assert set(LORA_TARGET_GROUPS) == set(LORA_TARGETS) and set(FREEZE_PARTS) == set(PARTS)


@pytest.mark.parametrize("rslora", [False, True])
def test_a_lora_layer_computes_the_formula(rslora):
    paddle.seed(3)
    base = nn.Linear(6, 5)
    layer = LoRALinear(base, LoRASettings(rank=4, alpha=8.0, targets=(), rslora=rslora))
    rng = np.random.default_rng(0)
    a, b, x = rng.normal(size=[6, 4]), rng.normal(size=[4, 5]), rng.normal(size=[3, 6])
    layer.lora_A.set_value(a.astype("float32"))
    layer.lora_B.set_value(b.astype("float32"))
    scaling = 8.0 / (np.sqrt(4) if rslora else 4)
    expected = x @ base.weight.numpy() + base.bias.numpy() + (x @ a @ b) * scaling
    np.testing.assert_allclose(layer(paddle.to_tensor(x.astype("float32"))).numpy(), expected, rtol=1e-5, atol=1e-5)
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias", "lora_A", "lora_B"]


def test_lora_starts_as_the_base_and_trains_only_its_pairs(tmp_path, base):
    full, adapted = trainer(tmp_path / "full", f"training.model_name_or_path={base}"), lora(tmp_path / "lora", base)
    batch = adapted.next_micro_batches()[0]
    np.testing.assert_array_equal(logits(adapted, batch), logits(full, batch))  # B starts at zero
    named = dict(adapted.parts.model.stable_named_parameters())
    before = {n: p.numpy().copy() for n, p in named.items()}
    trainable = {n for n, p in named.items() if not p.stop_gradient}
    assert trainable and trainable == {n for n in named if is_lora(n)}
    targets = {n.rsplit(".", 1)[0] for n in trainable}
    assert "model.layers.1.mlp.experts.4.up_gate_proj" in targets and "model.layers.0.self_attn.qkv_proj" in targets
    assert not any(t.startswith(("vision_model", "model.resampler_model")) for t in targets)  # default targets
    optimized = {p.name for p in adapted.parts.optimizer._parameter_list}
    assert optimized == {named[n].name for n in trainable}
    for adapted.step in range(1, 4):
        adapted.train_step()
    for name, value in before.items():
        if name in trainable:
            assert name.endswith("lora_A") or np.abs(named[name].numpy()).max() > 0, name
        else:  # frozen, the router bias included (no aux-free updates)
            np.testing.assert_array_equal(named[name].numpy(), value, err_msg=name)
    assert not np.array_equal(logits(adapted, batch), logits(full, batch))


def test_recompute_trains_the_pairs_when_nothing_before_them_trains(tmp_path, base):
    """The decoder's input needs no gradient (frozen embeddings): recomputed layers must still give their
    pairs the gradients of the plain run."""
    grads = []
    for name, extra in (("plain", []), ("recompute", ["training.recompute=true"])):
        tr = lora(tmp_path / name, base, *extra)
        tr.parts.runner.forward_backward(tr.next_micro_batches(), 0.01)
        grads.append({n: p.grad.numpy() for n, p in tr.parts.model.stable_named_parameters() if p.grad is not None})
    assert set(grads[1]) == set(grads[0]) and len(grads[0]) > 20
    for name, value in grads[0].items():
        np.testing.assert_allclose(grads[1][name], value, rtol=1e-5, atol=1e-7, err_msg=name)


def test_the_adapter_loads_back_and_merges_into_the_lora_models_logits(tmp_path, base):
    tr = lora(tmp_path / "run", base)
    for tr.step in range(1, 4):
        tr.train_step()
    batch = tr.next_micro_batches()[0]
    trained = logits(tr, batch)
    tr._finish({})
    adapter_dir = tmp_path / "run" / "final_model"
    config = json.loads((adapter_dir / "lora_config.json").read_text())
    assert config["r"] == 8 and config["scaling"] == 2.0 and config["base_model_name_or_path"] == str(base.resolve())

    loaded = load_model_folder(adapter_dir)  # generation and evaluation read an adapter folder as base + pairs
    with paddle.no_grad():
        np.testing.assert_allclose(loaded.model(batch, return_logits=True).logits.numpy(), trained, rtol=1e-5,
                                   atol=1e-5)
    merged = tmp_path / "merged"
    done = subprocess.run([sys.executable, "-m", "ernie_moe.export", str(adapter_dir), str(merged), "--merge-lora"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    plain = load_model_folder(merged)
    assert not any(is_lora(n) for n, _ in plain.model.stable_named_parameters())
    with paddle.no_grad():
        np.testing.assert_allclose(plain.model(batch, return_logits=True).logits.numpy(), trained, rtol=1e-5,
                                   atol=1e-5)


def test_a_lora_run_averages_its_pairs_and_saves_their_ema_as_the_adapter(tmp_path, base):
    """The EMA of a LoRA run holds the pairs only (the frozen base is not averaged); with save_ema_as_final the
    adapter written is the averaged pairs, and the model keeps its trained ones."""
    tr = lora(tmp_path / "run", base, "training.ema_decay=0.5", "training.save_ema_as_final=true")
    named = dict(tr.parts.model.stable_named_parameters())
    assert {n for n, _, _ in tr.parts.ema.owned} == {n for n, p in named.items() if not p.stop_gradient}
    assert all(is_lora(n) for n, _, _ in tr.parts.ema.owned)
    for tr.step in range(1, 4):
        tr.train_step()
    trained = {n: p.numpy() for n, p in named.items() if is_lora(n)}
    tr._finish({})
    _, adapter = read_adapter(tmp_path / "run" / "final_model", tr.cfg.model)
    averaged = {n: tr.parts.ema.values[id(named[n])].numpy() for n in trained}
    assert adapter and set(adapter) == set(averaged)
    for name, value in adapter.items():
        np.testing.assert_array_equal(value, averaged[name], err_msg=name)
        np.testing.assert_array_equal(named[name].numpy(), trained[name], err_msg=name)
    assert any(not np.array_equal(averaged[n], trained[n]) for n in trained)


def test_the_bases_generation_settings_reach_the_final_model(tmp_path, base):
    """The base folder's generation_config.json (its sampling settings) is carried into what the run writes, the
    special ids those of the run's tokenizer; a LoRA run's adapter and a full run's model alike."""
    folder = tmp_path / "base"
    folder.mkdir()
    for f in base.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "generation_config.json").write_text(json.dumps({"top_p": 0.8, "temperature": 0.2, "do_sample": True,
                                                               "eos_token_id": 999}))
    for mode, tr in (("lora", lora(tmp_path / "lora", folder)),
                     ("full", trainer(tmp_path / "full", f"training.model_name_or_path={folder}"))):
        tr._finish({})
        written = json.loads((tmp_path / mode / "final_model" / "generation_config.json").read_text())
        assert written["top_p"] == 0.8 and written["temperature"] == 0.2 and written["do_sample"] is True, mode
        assert written["eos_token_id"] == tr.tokenizer.eos_id != 999 and written["use_cache"] is True, mode


def test_freezing_parts_and_the_vit_learning_rates(tmp_path):
    tr = trainer(tmp_path, "training.freeze=[vision, router]", "training.vit_lr_ratio=0.5", "training.visual_ld=0.8",
                 "training.moe_gate_lr_ratio=2.0", "model.moe_use_aux_free=true")
    named = tr.parts.model.stable_named_parameters()
    for name, param in named:
        frozen = name.startswith("vision_model.") or ".mlp.gate." in name or "correction_bias" in name
        assert param.stop_gradient == frozen, name
    assert all(m.moe_statics.frozen for m in tr.parts.model.moe_layers())
    ratios = learning_rate_ratios(tr.parts.model, tr.cfg.training)
    by_name = {n: ratios[id(p)] for n, p in named}
    depth = tr.cfg.model.vision_config.depth
    assert by_name["vision_model.ln.weight"] == 0.5
    assert by_name["vision_model.blocks.1.attn.qkv.weight"] == pytest.approx(0.5 * 0.8 ** (depth - 1))
    assert by_name["vision_model.blocks.0.attn.qkv.weight"] == pytest.approx(0.5 * 0.8 ** depth)
    assert by_name["vision_model.patch_embed.proj.weight"] == pytest.approx(0.5 * 0.8 ** (depth + 1))
    assert by_name["model.layers.1.mlp.gate.weight"] == 2.0 and by_name["model.norm.weight"] == 1.0
    optimized = {p.name for p in tr.parts.optimizer._parameter_list}
    assert optimized == {p.name for n, p in named if not p.stop_gradient}  # frozen parts: no optimizer state


def test_lora_pairs_in_a_frozen_part_are_a_config_error(tmp_path, base):
    """LoRA on the ViT with the ViT frozen (the fine-tune config's ERNIEKit default) would make pairs that never
    train: refused, naming the way out; the same targets with the ViT free train them."""
    with pytest.raises(ConfigError, match=r"LoRA pairs in vision, which training.freeze \['vision'\] freezes"):
        lora(tmp_path / "frozen", base, "training.lora_targets=[attention, vit]", "training.freeze=[vision]")
    tr = lora(tmp_path / "free", base, "training.lora_targets=[attention, vit]")
    named = tr.parts.model.stable_named_parameters()
    assert any(n.startswith("vision_model.") and not p.stop_gradient for n, p in named)


def test_a_run_where_nothing_trains_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="nothing trains"):
        trainer(tmp_path, "training.freeze=[vision, adapter, lm]")


def test_written_target_patterns_match_only_the_adapted_layers():
    layers = {f"model.layers.{i}.mlp.experts.{j}.up_gate_proj" for i in (1, 2) for j in range(4)}
    text = {n for n in layers if int(n.split(".")[5]) < 2}
    patterns = target_patterns(text, layers)  # experts 2 and 3 are not adapted: no collapsed expert number
    import re

    assert {n for n in layers if any(re.fullmatch(p, n) for p in patterns)} == text
    assert target_patterns(layers, layers) == [r"model\.layers\.\d+\.mlp\.experts\.\d+\.up_gate_proj"]


@pytest.mark.parametrize("overrides, message", [
    (["training.lora_rank=0"], "lora_rank must be at least 1"),
    (["training.lora_targets=[attention, '(bad']"], "neither a group"),
    (["training.freeze=[eyes]"], "unknown parts"),
])
def test_bad_fine_tuning_settings_are_config_errors(base, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["training.fine_tuning=lora", f"training.model_name_or_path={base}", *overrides])


def test_lora_needs_a_base_and_targets_that_exist(tmp_path, base):
    with pytest.raises(ConfigError, match="model_name_or_path"):
        load_config(None, ["training.fine_tuning=lora"])
    with pytest.raises(ConfigError, match="'lm_head_typo' matched no linear layer"):
        lora(tmp_path, base, "training.lora_targets=[attention, lm_head_typo]")


def test_an_adapter_config_with_settings_of_the_wrong_kind_is_a_checkpoint_error(tmp_path, base):
    tr = lora(tmp_path / "run", base, "training.max_steps=1")
    tr._finish({})
    folder = tmp_path / "run" / "final_model"
    written = json.loads((folder / "lora_config.json").read_text())
    (folder / "lora_config.json").write_text(json.dumps({**written, "target_modules": "q_proj"}))
    settings, _ = read_adapter(folder)  # one pattern, as PaddleFormers allows, not one per letter
    assert settings.targets == ("q_proj",) and settings.rank == 8
    for change in ({"r": "8"}, {"r": 0}, {"r": True}, {"lora_alpha": None}, {"target_modules": [1]}, {"r": None}):
        (folder / "lora_config.json").write_text(json.dumps({**written, **change}))
        with pytest.raises(CheckpointError, match="cannot read the LoRA adapter in .*: lora_config.json needs r "
                                                  r"\(at least 1\), lora_alpha \(a number\) and target_modules"):
            read_adapter(folder)
    (folder / "lora_config.json").write_text(json.dumps([written]))
    with pytest.raises(CheckpointError, match="it holds r=None, lora_alpha=None, target_modules=None"):
        read_adapter(folder)


def test_an_adapter_of_another_shape_does_not_merge_or_load(tmp_path, base):
    tr = lora(tmp_path / "run", base, "training.max_steps=1")
    tr._finish({})
    adapter = read_adapter(tmp_path / "run" / "final_model")
    wider = load_config(None, ["model.hidden_size=96"]).model
    with pytest.raises(CheckpointError, match="another shape"):
        merged_weight("model.layers.0.mlp.down_proj.weight", np.zeros([128, 96], "float32"), adapter, wider)
    other = trainer(tmp_path / "other", "model.intermediate_size=96")
    with pytest.raises(CheckpointError, match="another shape"):
        load_adapter(other.parts.model, other.cfg.model, tmp_path / "run" / "final_model")
    # a pair of nan values (a diverged run) is named as it loads, not met at the first step
    folder = tmp_path / "run" / "final_model"
    shard = folder / sorted(set(json.loads((folder / "peft_model.safetensors.index.json").read_text())
                                ["weight_map"].values()))[0]
    tensors = load_file(str(shard))
    name = sorted(n for n in tensors if "lora_B" in n)[0]
    tensors[name][:] = np.nan
    save_file(tensors, str(shard), metadata={"format": "np"})
    same = trainer(tmp_path / "same")
    with pytest.raises(CheckpointError, match="holds nan or inf values: the adapter is damaged"):
        load_adapter(same.parts.model, same.cfg.model, folder)
