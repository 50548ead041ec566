"""The LM head and loss over sequence chunks (``training.loss_subbatch_seqlen``): the same training, and the
whole logits never held."""

import numpy as np
import paddle
import pytest
from support.runs import ROOT, launch, load_model, records, trained

from ernie_moe.config import ConfigError, load_config
from ernie_moe.training import Trainer


@pytest.mark.parametrize("tied", ["true", "false"])
def test_chunks_train_as_the_whole_sequence(tmp_path, tied):
    """5 steps with chunks of 16 of the 48 tokens (the last chunk of a row also cut): the losses and final
    weights of the unchunked run within 1e-5, and evaluation unchanged."""
    plain, plain_weights, a = trained(tmp_path / "plain", f"model.tie_word_embeddings={tied}")
    chunked, chunked_weights, b = trained(tmp_path / "chunked", f"model.tie_word_embeddings={tied}",
                                          "training.loss_subbatch_seqlen=20")
    np.testing.assert_allclose(chunked, plain, rtol=1e-5)
    for name, value in plain_weights.items():
        np.testing.assert_allclose(chunked_weights[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    for key, value in a.evaluate().items():
        assert abs(b.evaluate()[key] - value) < 1e-6, key


def test_the_whole_logits_are_not_held(tmp_path):
    """Vocabulary 32k, 2048 tokens in the micro-batch (4 rows of 512): chunks of 64 positions (256 tokens) lower
    the allocator peak of a forward and backward by at least the float32 logits they no longer hold (250 MiB
    for the whole batch, less one chunk's 31 MiB)."""
    core = paddle.base.core

    def peak(*overrides):
        tr = Trainer(load_config(ROOT / "configs" / "vl_moe.yaml", [
            "model.vocab_size=32000", "data.max_seq_len=512", "training.per_device_train_batch_size=4",
            "logging.visualdl=false", f"training.output_dir={tmp_path / str(len(overrides))}", *overrides]))
        batch = tr.next_micro_batches()[0]
        assert batch.input_ids.shape == [4, 512]
        base = core.host_memory_stat_current_value("Allocated", 0)
        core.host_memory_stat_reset_peak_value("Allocated", 0)
        out = tr.parts.model(batch)
        (out.loss_sum + out.router_loss).backward()
        return core.host_memory_stat_peak_value("Allocated", 0) - base

    whole, chunked = peak(), peak("training.loss_subbatch_seqlen=64")
    logits, one_chunk = 4 * 512 * 32000 * 4, 4 * 64 * 32000 * 4
    assert whole - chunked >= logits - one_chunk, (whole / 2 ** 20, chunked / 2 ** 20)


def test_chunks_that_do_not_divide_over_the_sequence_parallel_ranks_are_refused():
    sequence_parallel = ["parallel.tensor_parallel_degree=2", "parallel.sequence_parallel=true",
                         "parallel.moe_group=mp"]
    with pytest.raises(ConfigError, match=r"loss_subbatch_seqlen \(15\) must be divisible"):
        load_config(None, ["training.loss_subbatch_seqlen=15", *sequence_parallel], check_paths=False)
    for layout in (["parallel.pipeline_parallel_degree=2", "training.gradient_accumulation_steps=2"],
                   sequence_parallel):
        assert load_config(None, ["training.loss_subbatch_seqlen=16", *layout], check_paths=False)
    with pytest.raises(ConfigError, match="loss_subbatch_seqlen"):
        load_config(None, ["training.loss_subbatch_seqlen=-1"])
    with pytest.raises(ConfigError, match="not shorter than data.max_seq_len"):
        load_config(None, ["training.loss_subbatch_seqlen=64", "data.max_seq_len=64"])


@pytest.mark.slow
def test_chunks_through_the_vocabulary_parallel_loss_train_as_the_whole_sequence(tmp_path):
    """tp2: the head's logits split over the vocabulary, the loss over chunks of 16 positions or not."""
    runs = {}
    for chunk in (0, 16):
        out, _ = launch(tmp_path, 2, "parallel.tensor_parallel_degree=2", f"training.loss_subbatch_seqlen={chunk}",
                        "training.max_steps=5", "logging.logging_steps=1", "training.eval_steps=0",
                        "training.adam_epsilon=1e-6", "training.per_device_train_batch_size=4", name=f"chunk{chunk}")
        runs[chunk] = out
    losses = {c: [r["loss"] for r in records(out) if "loss" in r] for c, out in runs.items()}
    np.testing.assert_allclose(losses[16], losses[0], rtol=1e-5)
    a, b = load_model(runs[0] / "final_model"), load_model(runs[16] / "final_model")
    for name, value in a.items():
        np.testing.assert_allclose(b[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
