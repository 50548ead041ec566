from collections import Counter

import numpy as np
import paddle
import pytest
from support.models import first_batch, first_rows

from ernie_moe.config import load_config
from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration
from ernie_moe.model.vision import Adapter, VisionTransformer, frame_shares, image_token_count


def build(cfg, seed=0):
    paddle.seed(seed)
    model = ErnieMoEForConditionalGeneration(cfg.model)
    model.eval()
    return model


def test_dense_and_moe_layers_follow_the_config(tiny_cfg):
    model = build(tiny_cfg)
    assert [layer.is_moe for layer in model.model.layers] == [False, True]
    names = dict(model.named_parameters())
    assert names["model.layers.1.mlp.gate.weight"].shape == [64, 4]
    assert names["model.layers.1.mlp.gate.weight_1"].shape == [64, 4]
    assert names["model.layers.1.mlp.experts.4.up_gate_proj.weight"].shape == [64, 64]  # vision width 32 x 2
    assert names["model.layers.0.self_attn.qkv_proj.weight"].shape == [64, (4 + 2 * 2) * 16]
    assert names["model.layers.1.mlp.gate.weight"].dtype == paddle.float32


def test_adapter_merges_space_and_time():
    cfg = load_config(None, ["model.vision_config.depth=1"]).model
    paddle.seed(0)
    vit, adapter = VisionTransformer(cfg.vision_config), Adapter(cfg)
    grids = np.array([[1, 4, 6], [3, 2, 2]])  # a still image and a 3-frame clip
    patches = paddle.randn([int(grids.prod(1).sum()), 3 * 14 * 14])
    feats = adapter(vit(patches, grids), grids)
    expected = sum(image_token_count(g, 2, 2) for g in grids)
    assert feats.shape == [expected, cfg.hidden_size] and expected == 6 + 2


def test_vit_attention_stays_inside_each_image():
    cfg = load_config(None).model
    paddle.seed(0)
    vit = VisionTransformer(cfg.vision_config)
    grids = np.array([[1, 2, 2], [1, 2, 4]])
    patches = paddle.randn([12, 588])
    base = vit(patches, grids).numpy()
    changed = patches.numpy().copy()
    changed[4:] += 1.0  # alter only the second image
    other = vit(paddle.to_tensor(changed), grids).numpy()
    np.testing.assert_allclose(base[:4], other[:4], rtol=1e-5, atol=1e-6)
    assert np.abs(base[4:] - other[4:]).max() > 1e-3


def test_vit_batches_images_of_one_size_and_keeps_their_order():
    """Images of mixed sizes in one call give what each gives alone (attention runs per group of one size)."""
    cfg = load_config(None).model
    paddle.seed(0)
    vit = VisionTransformer(cfg.vision_config)
    grids = np.array([[1, 2, 2], [1, 2, 4], [1, 2, 2], [2, 2, 2]])
    sizes = grids.prod(axis=1)
    patches = paddle.randn([int(sizes.sum()), 588])
    together = vit(patches, grids).numpy()
    start = 0
    for grid, size in zip(grids, sizes):
        alone = vit(patches[start: start + size], grid[None]).numpy()
        np.testing.assert_allclose(together[start: start + size], alone, rtol=1e-5, atol=1e-6)
        start += size


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_frame_shares_cover_every_frame_once_in_balanced_contiguous_shares(parts):
    grids = np.array([[1, 4, 4], [3, 2, 2], [1, 2, 4]])  # frames of 16, 4, 4, 4 and 8 patches
    frames = [16, 4, 4, 4, 8]
    shares = frame_shares(grids, parts)
    assert len(shares) == parts
    assert shares[0][0] == 0 and shares[-1][1] == 36
    for (_, stop, _), (start, _, _) in zip(shares, shares[1:]):
        assert stop == start  # contiguous, in order
    for start, stop, grid in shares:
        assert int(grid.prod(axis=1).sum()) == stop - start
        assert stop - start <= 36 / parts + max(frames)  # no share over its fair part by more than a frame
    # the shares' grids, frames put back together per image, are the batch's
    frames_of = Counter()
    for _, _, grid in shares:
        for t, h, w in grid.tolist():
            frames_of[(h, w)] += t
    assert frames_of == Counter({(4, 4): 1, (2, 2): 3, (2, 4): 1})
    assert all(start == stop == 0 for start, stop, _ in frame_shares(np.zeros([0, 3]), parts))


def test_image_features_reach_only_their_own_document(tiny_cfg):
    model = build(tiny_cfg)
    batch = first_batch(tiny_cfg, rows=1)
    doc = first_rows(tiny_cfg, rows=1)[0].doc_ids
    assert doc.max() >= 1, "the test needs a row that packs two documents"
    base = model(batch, return_logits=True).logits.numpy()[0]
    per_image = batch.grid_thw.prod(axis=1)
    patches = batch.pixel_patches.numpy().copy()
    patches[per_image[0]:] += 1.0  # change every image except the first document's
    batch.pixel_patches = paddle.to_tensor(patches)
    other = model(batch, return_logits=True).logits.numpy()[0]
    first = doc == 0
    np.testing.assert_allclose(base[first], other[first], rtol=1e-5, atol=1e-5)
    assert np.abs(base[doc == 1] - other[doc == 1]).max() > 1e-4


def test_placeholder_count_must_match_the_images(tiny_cfg):
    model = build(tiny_cfg)
    batch = first_batch(tiny_cfg, rows=1)
    batch.grid_thw = batch.grid_thw[:-1]
    batch.pixel_patches = batch.pixel_patches[: int(batch.grid_thw.prod(axis=1).sum())]
    with pytest.raises(ValueError, match="image placeholder tokens"):
        model(batch)


def test_loss_counts_tokens_not_micro_batches(tiny_cfg, tmp_path):
    """One step over 4 rows equals two accumulated micro-batches of 2 rows: every label token weighs the same."""
    from ernie_moe.training.trainer import Trainer

    common = ["model.moe_aux_loss_lambda=0", "model.moe_z_loss_lambda=0", "model.moe_orthogonal_loss_lambda=0",
              "logging.visualdl=false", f"training.output_dir={tmp_path}", "training.max_grad_norm=0",
              "data.image_size=56", "data.max_seq_len=48", "training.warmup_steps=0"]
    whole = Trainer(load_config(None, common + ["training.per_device_train_batch_size=4"]))
    split = Trainer(load_config(None, common + ["training.per_device_train_batch_size=2",
                                                "training.gradient_accumulation_steps=2"]))
    a = whole.forward_backward(whole.next_micro_batches()).read()
    b = split.forward_backward(split.next_micro_batches()).read()
    assert a.label_tokens == b.label_tokens
    np.testing.assert_allclose(a.lm_loss_sum, b.lm_loss_sum, rtol=1e-5)
    for (name, p), q in zip(whole.parts.model.named_parameters(), split.parts.model.parameters()):
        if p.stop_gradient:
            continue
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-4, atol=1e-7, err_msg=name)


def test_token_balanced_loss_uses_a_fixed_denominator():
    from ernie_moe.objectives.sums import loss_denominator

    cfg = load_config(None, ["training.token_balance_loss=true", "training.token_balance_seqlen=100",
                             "training.gradient_accumulation_steps=3"])
    counts = paddle.to_tensor([57.0, 40.0])  # the label count, and one depth's
    fixed = loss_denominator(cfg.training, cfg.data.max_seq_len, 4, 3, 1)(counts)
    assert fixed.numpy().tolist() == [300.0, 300.0]
    by_rows = load_config(None, ["training.token_balance_loss=true", "data.max_seq_len=64"]).training
    assert loss_denominator(by_rows, 64, 4, 3, 2)(counts).numpy().tolist() == [64 * 4 * 3 * 2] * 2
    plain = loss_denominator(load_config(None, []).training, 64, 4, 3, 2)
    assert plain(paddle.to_tensor([57.0, 0.0])).numpy().tolist() == [57.0, 1.0]


def test_text_only_batches_still_give_every_parameter_a_gradient(tiny_cfg):
    model = build(tiny_cfg)
    model.train()
    batch = first_batch(tiny_cfg, rows=1)
    text = batch.token_type_ids.numpy() != 1
    batch.input_ids = paddle.to_tensor(np.where(text, batch.input_ids.numpy(), 5))
    batch.token_type_ids = paddle.to_tensor(np.where(text, batch.token_type_ids.numpy(), 0))
    batch.pixel_patches = batch.pixel_patches[:0]
    batch.grid_thw = batch.grid_thw[:0]
    out = model(batch)
    (out.loss_sum + out.router_loss).backward()
    missing = [n for n, p in model.named_parameters() if not p.stop_gradient and p.grad is None]
    assert missing == []
    assert float(model.vision_model.patch_embed.proj.weight.grad.abs().sum()) == 0.0
