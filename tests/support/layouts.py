"""The layouts' overrides that the layout tests of several features share."""

# Router statistics are those of one micro-batch: layouts that accumulate micro-batches (every pipeline) are
# compared with a single process that accumulates the same micro-batches.
ACCUMULATE = ["training.gradient_accumulation_steps=2"]


# one multi-token prediction depth; and PaddleFormers' train_mtp_only: everything else frozen
MTP = ["model.num_nextn_predict_layers=1"]


TP2, PP2 = "parallel.tensor_parallel_degree=2", "parallel.pipeline_parallel_degree=2"
