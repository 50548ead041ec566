"""Multi-token prediction (``model.num_nextn_predict_layers``): its labels, its loss's weight in a training step, and
starting its layers from a model that has none. Against PaddleFormers: tests/data/test_ernie_inputs.py; in every layout:
tests/launches/test_layouts.py."""

import numpy as np
import paddle
import pytest
from support.runs import ROOT

from ernie_moe.batch import IGNORE_INDEX, HostCounts
from ernie_moe.checkpoint.model_files import save_model
from ernie_moe.checkpoint.pretrained import load_pretrained
from ernie_moe.config import ConfigError, load_config
from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration
from ernie_moe.model.mtp import labels_ahead
from ernie_moe.monitor.monitor import mtp_metrics
from ernie_moe.training import Trainer

# two depths need three layers: PaddleFormers builds depth k as decoder layer k, which must be dense
TWO_DEPTHS = ["model.num_hidden_layers=3", "model.moe_layer_start_index=2", "model.num_nextn_predict_layers=2",
              "model.multi_token_pred_lambda=0.3"]
SMALL = ["data.image_size=56", "data.max_seq_len=48", "training.per_device_train_batch_size=2",
         "training.gradient_accumulation_steps=2", "logging.visualdl=false", "training.eval_steps=0",
         "data.num_eval_samples=8", "logging.logging_steps=1"]


def test_labels_ahead_follow_documents_as_numpy_does():
    """Depth k's label at position i is the label at i + k when both are in one packed document; the host counts
    (what the step divides each depth's loss by) count exactly those."""
    rng = np.random.default_rng(0)
    rows, seq = 3, 20
    labels = rng.integers(0, 50, (rows, seq))
    labels[rng.random((rows, seq)) < 0.3] = IGNORE_INDEX
    ends = np.array([[7] * 7 + [15] * 8 + [20] * 5, [20] * 20, [1] + [12] * 11 + [20] * 8])  # document ends
    got = labels_ahead(paddle.to_tensor(labels), paddle.to_tensor(ends), 3).numpy().reshape([3, rows, seq])
    counts = HostCounts.of(labels, np.zeros_like(labels), key_ends=ends, depths=3).labels_ahead
    for k in range(1, 4):
        expected = np.full((rows, seq), IGNORE_INDEX)
        for r in range(rows):
            for i in range(seq - k):
                if ends[r, i] > i + k:  # i + k is in i's document
                    expected[r, i] = labels[r, i + k]
        np.testing.assert_array_equal(got[k - 1], expected, err_msg=f"depth {k}")
        assert counts[k - 1] == (expected != IGNORE_INDEX).sum()
    assert counts[0] > counts[2] > 0


@pytest.mark.parametrize("chunk", [0, 16], ids=["whole", "chunked"])
def test_a_step_weighs_each_depth_by_lambda_over_its_labels(tmp_path, chunk):
    """The step's gradients (two micro-batches) are those of lm loss / labels + router losses + lambda x the mean
    over depths of each depth's loss / its labels, computed here from the model's outputs, with the head and loss
    over sequence chunks too; the logged depth losses are each depth's mean."""
    tr = Trainer(load_config(ROOT / "configs" / "vl_moe.yaml", [*SMALL, *TWO_DEPTHS, f"training.output_dir={tmp_path}",
                                                                  f"training.loss_subbatch_seqlen={chunk}"]))
    micro_batches = tr.next_micro_batches()
    result = tr.forward_backward(micro_batches).read()
    params = [p for p in tr.parts.model.parameters() if not p.stop_gradient]
    ours = {id(p): p.grad.numpy().copy() for p in params if p.grad is not None}
    tr.parts.optimizer.clear_grad()

    outs = [tr.parts.model(b) for b in micro_batches]
    ahead = [(labels_ahead(b.labels, b.key_ends, 2) != IGNORE_INDEX).reshape([2, -1]).sum(axis=1)
             for b in micro_batches]
    labels = sum(o.num_label_tokens for o in outs)
    counts = (ahead[0] + ahead[1]).astype("float32")
    assert counts.numpy().tolist() == [sum(b.counts.labels_ahead[k] for b in micro_batches) for k in range(2)]
    loss = sum(o.loss_sum / labels + o.router_loss / 2 + 0.3 / 2 * (o.mtp_sums / counts).sum() for o in outs)
    loss.backward()
    mtp_params = {id(p) for n, p in tr.parts.model.named_parameters() if ".mtp_" in n}
    assert mtp_params and mtp_params <= set(ours)
    for p in params:
        if id(p) in ours:
            np.testing.assert_allclose(ours[id(p)], p.grad.numpy(), rtol=1e-4, atol=1e-7, err_msg=p.name)
    sums = (outs[0].mtp_sums + outs[1].mtp_sums).numpy()
    logged = mtp_metrics(np.asarray(result.mtp))
    np.testing.assert_allclose([logged["mtp/depth1_loss"], logged["mtp/depth2_loss"]], sums / counts.numpy(),
                               rtol=1e-5)
    assert logged["mtp/loss"] == pytest.approx(np.mean(sums / counts.numpy()))


def test_mtp_layers_start_from_the_last_layer_of_a_model_without_them(tmp_path):
    """training.mtp_init last_layer: each depth's attention and norms are the last decoder layer's, its MLP the last
    dense layer's, reported as copied; the projection and its norms start as drawn. By default they are new. A LoRA
    run, whose adapter holds only its pairs, refuses to start them (the adapter could not be loaded with them)."""
    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", ["model.num_hidden_layers=3", "model.moe_layer_start_index=2"])
    paddle.seed(1)
    plain = ErnieMoEForConditionalGeneration(cfg.model)
    save_model(plain, cfg.model, str(tmp_path / "plain"))
    source = {n: p.numpy() for n, p in plain.stable_named_parameters()}
    with_mtp = load_config(ROOT / "configs" / "vl_moe.yaml", ["model.num_hidden_layers=3",
                                                              "model.moe_layer_start_index=2", *TWO_DEPTHS[2:]])
    model = ErnieMoEForConditionalGeneration(with_mtp.model)
    report = load_pretrained(model, tmp_path / "plain", mtp_init="last_layer")
    assert len(report["copied"]) == 2 * 6 and report["ignored"] == []
    assert sorted(report["new"]) == sorted(f"model.mtp_{part}.{k}.weight" for k in range(2)
                                           for part in ("emb_norm", "hidden_norm", "linear_proj"))
    weights = {n: p.numpy() for n, p in model.stable_named_parameters()}
    for k in range(2):
        for part in ("input_layernorm", "post_attention_layernorm", "self_attn.qkv_proj", "self_attn.o_proj"):
            np.testing.assert_array_equal(weights[f"model.mtp_block.{k}.{part}.weight"],
                                          source[f"model.layers.2.{part}.weight"])
        for part in ("up_gate_proj", "down_proj"):  # layer 2 is the MoE layer: layer 1 is the last dense one
            np.testing.assert_array_equal(weights[f"model.mtp_block.{k}.mlp.{part}.weight"],
                                          source[f"model.layers.1.mlp.{part}.weight"])
    scratch = load_pretrained(ErnieMoEForConditionalGeneration(with_mtp.model), tmp_path / "plain")
    assert scratch["copied"] == [] and len(scratch["new"]) == 2 * 9
    for init in ("scratch", "last_layer"):
        lora = load_config(ROOT / "configs" / "vl_moe.yaml", [
            "model.num_hidden_layers=3", "model.moe_layer_start_index=2", *TWO_DEPTHS[2:], *SMALL,
            f"training.model_name_or_path={tmp_path / 'plain'}", "training.fine_tuning=lora",
            "training.lora_targets=[attention,mtp]", f"training.mtp_init={init}",
            f"training.output_dir={tmp_path / init}"])
        with pytest.raises(ConfigError, match="has no multi-token prediction depths"):
            Trainer(lora)
