"""End to end: the trainer launched the way users launch it, and what it leaves in the output folder."""

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file
from support.runs import ROOT, launch, records

pytestmark = pytest.mark.slow  # starts processes


def test_launched_run_writes_metrics_visualdl_and_model(tmp_path):
    out, log = launch(tmp_path, 1, "training.max_steps=6", "logging.logging_steps=2", "training.eval_steps=3")
    rows = records(out)
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6]
    for key in ("loss", "lm_loss", "aux_loss", "z_loss", "orthogonal_loss", "lr", "grad_norm", "tokens_per_sec",
                "step_time_s", "router_loss", "samples_per_sec"):
        assert all(np.isfinite(r[key]) for r in train), key
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6] and "eval_caption_accuracy" in evals[0]
    assert "done: 6 steps" in log

    from visualdl import LogReader

    logs = list((out / "visualdl").glob("vdlrecords.*.log"))
    assert len(logs) == 1
    reader = LogReader(file_path=str(logs[0]))
    losses = reader.get_data("scalar", "train/loss")
    assert [r.id for r in losses] == [2, 4, 6]
    np.testing.assert_allclose([r.value for r in losses], [r["loss"] for r in train], rtol=1e-5)
    assert [r.id for r in reader.get_data("scalar", "eval/eval_loss")] == [3, 6]

    model_dir = out / "final_model"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "ernie4_5_moe_vl" and config["moe_num_experts"] == [4, 4]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in set(index["weight_map"].values()):
        tensors.update(load_file(str(model_dir / shard)))
    assert set(tensors) == set(index["weight_map"])
    assert tensors["model.layers.1.mlp.gate.weight_1"].shape == (64, 4)
    # PaddleFormers' file layout: [out, in] linears, separate q/k/v and gate/up
    assert tensors["vision_model.patch_embed.proj.weight"].shape == (32, 588)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    assert tensors["model.layers.1.mlp.experts.4.gate_proj.weight"].shape == (32, 64)
    assert not any("qkv_proj" in name or "up_gate_proj" in name for name in tensors)


def test_two_data_parallel_ranks_match_one_process_and_log_per_rank(tmp_path):
    """Same seed, same global batch: dp2 reproduces the single-process losses and final weights."""
    # adam_epsilon 1e-6: Adam's first steps turn float noise in near-zero gradients into full-size updates.
    common = ["training.max_steps=4", "logging.logging_steps=1", "training.eval_steps=0", "training.adam_epsilon=1e-6",
              "model.moe_aux_loss_lambda=0", "model.moe_z_loss_lambda=0", "model.moe_orthogonal_loss_lambda=0"]
    one, _ = launch(tmp_path, 1, *common, "training.per_device_train_batch_size=4", name="one")
    two, _ = launch(tmp_path, 2, *common, "training.per_device_train_batch_size=2", name="two")
    losses = [[r["loss"] for r in records(out) if "loss" in r] for out in (one, two)]
    assert len(losses[0]) == 4
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    # expert counters are summed over both ranks: the same global batch routes the same number of tokens
    for key in ("moe/layer1_text/routed_tokens", "moe/layer1_vision/routed_tokens"):
        assert [r[key] for r in records(two) if "loss" in r] == [r[key] for r in records(one) if "loss" in r]
    last = [r for r in records(two) if "loss" in r][-1]
    assert last["memory/rank0/max_rss_gb"] > 0 and last["memory/rank1/max_rss_gb"] > 0  # one curve per rank
    assert last["memory/max_rank_max_allocated_gb"] >= last["memory/min_rank_max_allocated_gb"]
    a = load_file(str(one / "final_model" / "model-00001-of-00001.safetensors"))
    b = load_file(str(two / "final_model" / "model-00001-of-00001.safetensors"))
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("blank", [False, True])
def test_caption_words_need_the_image(tmp_path, blank):
    """The default run learns the image-dependent words; with blank images (a shorter run) it stays near chance."""
    from ernie_moe.config import load_config
    from ernie_moe.training import Trainer

    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", [
        f"training.output_dir={tmp_path}", "training.eval_steps=0", "logging.visualdl=false",
        "logging.progress_bar=false", "data.num_eval_samples=128", f"data.blank_images={str(blank).lower()}",
        *(["training.max_steps=400"] if blank else ["training.eval_generate=true"]),
    ])
    summary = Trainer(cfg).train()
    accuracy = summary["eval_caption_accuracy"]
    # chance: colour 1/6, shape 1/4, row 1/3, column 1/3 -> about 0.27
    if blank:
        assert accuracy < 0.4
        return
    print("default run:", {k: round(v, 4) for k, v in summary.items() if k.startswith("eval_")})
    assert accuracy >= 0.95
    # greedy captions of the 128 held-out images score the caption words within one sample's four words of the
    # teacher-forced figure (they differ only after a wrong word)
    assert summary["eval_generate_answers"] == 128
    assert abs(summary["eval_generate_caption_accuracy"] - accuracy) <= 4 / (4 * 128) + 1e-9
    # the saved model, read back: the evaluation command gives the trainer's figures, and greedy captions of
    # held-out images are mostly the reference captions
    from ernie_moe.data.formats.sample import Sample
    from ernie_moe.data.formats.synthetic import SyntheticShapes, caption
    from ernie_moe.evaluate import scores
    from ernie_moe.generation import generate, load_model_folder
    from ernie_moe.generation.prompts import prompt_encoder

    figures, _ = scores(summary["model_dir"], "synthetic", cfg, cfg.training.per_device_eval_batch_size,
                        cfg.training.max_eval_batches)
    for key in ("eval_loss", "eval_token_accuracy", "eval_caption_accuracy"):
        assert abs(figures[key] - summary[key]) < 1e-5, key
    loaded = load_model_folder(summary["model_dir"])
    model, tokenizer, model_cfg = loaded.model, loaded.tokenizer, loaded.cfg
    encoder = prompt_encoder(tokenizer, model_cfg, cfg.data)
    held_out = SyntheticShapes(cfg.training.seed, "eval", 20, cfg.data.image_size)
    right = 0
    for sample in (held_out[i] for i in range(20)):
        prompt = encoder.prompt(Sample(sample.images, sample.chunks[:1]))
        generated = generate(model, prompt, 12, tokenizer.eos_id, never=(model_cfg.im_patch_id,))
        right += tokenizer.decode(generated.ids) == caption(sample)
    print(f"{right} of 20 greedy captions exact")
    assert right >= 12, f"{right} of 20 captions right"


def test_unusable_data_stops_with_a_message_not_a_traceback(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"image": "missing.png", "text": "x"}\n{broken\n')
    result = subprocess.run(
        [sys.executable, str(ROOT / "run_trainer.py"), "--config", str(ROOT / "configs" / "vl_moe.yaml"),
         "data.dataset=jsonl", f"data.train_path={data}", "model.vocab_size=300", f"training.output_dir={tmp_path}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "data error: the training data has no usable sample" in result.stderr
    assert "missing_image" in result.stderr and "bad_json" in result.stderr
    assert "Traceback" not in result.stderr


def test_training_on_jsonl_files_with_a_sentencepiece_tokenizer(tmp_path):
    """Real-data path: PNG files + JSONL (captions and chats), a local SentencePiece model, two processes."""
    import sentencepiece as spm
    from PIL import Image

    from ernie_moe.data.formats.synthetic import SyntheticShapes

    shapes = SyntheticShapes(0, "train", 24, 84)
    lines, texts = [], []
    for i in range(24):
        sample = shapes[i]
        Image.fromarray(sample.images[0]).save(tmp_path / f"img{i}.png")
        caption = "".join(c.text for c in sample.chunks if c.text)
        texts.append(caption)
        if i % 2:
            lines.append({"image": f"img{i}.png", "text": caption})
        else:
            lines.append({"images": [f"img{i}.png"], "messages": [
                {"role": "user", "content": "<image>\nDescribe the picture."},
                {"role": "assistant", "content": caption}]})
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (tmp_path / "val.jsonl").write_text("\n".join(json.dumps(x) for x in lines[:4]) + "\n")
    (tmp_path / "corpus.txt").write_text("\n".join(texts + ["User: Describe the picture.", "Assistant:"] * 3))
    tok_dir = tmp_path / "tokenizer"
    tok_dir.mkdir()
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tok_dir / "tokenizer"),
                                   vocab_size=40, pad_id=0, bos_id=1, eos_id=2, unk_id=3,
                                   user_defined_symbols=["<image>"])
    out, log = launch(tmp_path, 2, "data.dataset=jsonl", f"data.train_path={tmp_path / 'train.jsonl'}",
                      f"data.eval_path={tmp_path / 'val.jsonl'}", f"data.tokenizer_path={tok_dir}",
                      "model.vocab_size=48", "model.im_patch_id=4", "data.max_seq_len=96", "data.max_image_side=56",
                      "training.max_steps=3", "logging.logging_steps=1", "training.per_device_train_batch_size=2")
    train = [r for r in records(out) if "loss" in r]
    assert len(train) == 3 and all(np.isfinite(r["loss"]) for r in train)
    assert "eval_loss" in records(out)[-1] and "eval_caption_accuracy" not in records(out)[-1]
    assert (out / "final_model" / "tokenizer.model").is_file()
    assert "done: 3 steps" in log
