"""PaddleFormers' side of the interop tests, run in its own process (importing PaddleFormers patches
libraries the rest of the suite uses).

    python paddleformers_side.py make KIND DIR [CONFIG]  # a random tiny ERNIE 4.5 model: DIR/hf (save_pretrained)
                                                    # and DIR/paddle (its in-memory state as model_state.pdparams);
                                                    # CONFIG: JSON of config fields over KIND's
    python paddleformers_side.py dump KIND DIR OUT  # from_pretrained(DIR), in-memory state -> OUT (.npz)
    python paddleformers_side.py logits DIR IDS OUT # dense model's forward logits on IDS (.npy) -> OUT (.npy)
    python paddleformers_side.py generate DIR IDS N OUT  # dense model's greedy generate(): N new tokens per row
    python paddleformers_side.py lora_logits KIND DIR ADAPTER IDS OUT  # logits of DIR with LoRAModel.from_pretrained
    python paddleformers_side.py lora_dump KIND DIR ADAPTER OUT  # the LoRA tensors LoRAModel.from_pretrained holds
    python paddleformers_side.py image IMAGE OUT  # ERNIE-4.5-VL's image processor on an .npy image
    python paddleformers_side.py process TOKENIZER CONVERSATIONS OUT  # Ernie4_5_VLProcessor on each conversation
    python paddleformers_side.py pieces TOKENIZER CASES OUT  # the processor fed one piece of text, image or video
                                                    # at a time (ERNIEKit tokenizes each piece on its own)
    python paddleformers_side.py frames CASES OUT  # the processor's video frame choice for (frames, seconds) pairs
    python paddleformers_side.py timestamps FRAMES TIMES FONT OUT  # the processor's time mark drawn on each frame
    python paddleformers_side.py vl_logits DIR OUT PROCESSED...  # the VL model's logits on `process` outputs,
                                                    # OUT/<stem>.npy each, on the CPU (paddleformers_cpu.py)
    python paddleformers_side.py vl_lora DIR ADAPTER OUT PROCESSED...  # the same with LoRAModel.from_pretrained,
                                                    # and the LoRA tensors it holds as OUT/lora_state.npz
    python paddleformers_side.py vl_mtp DIR OUT PROCESSED...  # the VL model's multi-token prediction on `process`
                                                    # outputs: each depth's logits (OUT/<stem>_mtp.npy) and loss
    python paddleformers_side.py vl_mtp_lora DIR ADAPTER OUT PROCESSED...  # the same with LoRAModel.from_pretrained,
                                                    # and the LoRA tensors it holds as OUT/lora_state.npz
    python paddleformers_side.py dpo DIR PAIRS OUT  # the dense model's logits of each side, laid out as its DPO
                                                    # data lays a pair out, through its DPOCriterion
"""

import json
import sys
from pathlib import Path

import numpy as np
import paddle

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
            fuse_rms_norm=False, tie_word_embeddings=False)
KINDS = {
    "dense": ("Ernie4_5Config", "Ernie4_5ForCausalLM", BASE),
    "moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
            dict(BASE, moe_num_experts=4, moe_intermediate_size=32, moe_k=2, moe_layer_start_index=1,
                 moe_num_shared_experts=1, moe_use_aux_free=True)),
    # PaddleFormers' VL model takes its head width from hidden_size / heads
    "vl": ("Ernie4_5_VLConfig", "Ernie4_5_VLMoeForConditionalGeneration",
           dict(BASE, freq_allocation=2, tie_word_embeddings=True, moe_num_experts=[4, 4],
                moe_intermediate_size=[32, 16], moe_k=2, moe_layer_start_index=1, moe_num_shared_experts=1,
                pixel_hidden_size=32, im_patch_id=4,
                vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                                   spatial_merge_size=2, in_channels=3))),
}


def classes(kind):
    import paddleformers.transformers as pf

    config_name, model_name, kwargs = KINDS[kind]
    return getattr(pf, config_name), getattr(pf, model_name), kwargs


def make(kind, directory, config="{}"):
    config_cls, model_cls, kwargs = classes(kind)
    paddle.seed(1)
    model = model_cls(config_cls(**dict(kwargs, **json.loads(config))))
    for name, value in model.state_dict().items():
        # PaddleFormers starts a modality's experts equal and the correction bias at zero, which would leave which
        # expert a token goes to unseen in the outputs: give each its own values
        if ".experts." in name:
            value.set_value(paddle.normal(0.0, 0.1, value.shape).astype(value.dtype))
        elif name.endswith("e_score_correction_bias"):
            value.set_value(paddle.uniform(value.shape, value.dtype, -0.3, 0.3))
    out = Path(directory)
    model.save_pretrained(str(out / "hf"))
    (out / "paddle").mkdir(parents=True)
    paddle.save(model.state_dict(), str(out / "paddle" / "model_state.pdparams"))
    config = json.loads((out / "hf" / "config.json").read_text())
    config.pop("torch_dtype")  # the in-memory (Paddle) layout
    (out / "paddle" / "config.json").write_text(json.dumps(config))
    for extra in (out / "hf").glob("saved_signal_*"):
        extra.unlink()


def dump(kind, directory, out):
    _, model_cls, _ = classes(kind)
    model = model_cls.from_pretrained(directory, convert_from_hf=True)
    np.savez(out, **{k: v.astype("float32").numpy() for k, v in model.state_dict().items()})


def logits(directory, ids, out):
    _, model_cls, _ = classes("dense")
    model = model_cls.from_pretrained(directory, convert_from_hf=True)
    model.eval()
    with paddle.no_grad():
        result = model(input_ids=paddle.to_tensor(np.load(ids)))
    np.save(out, (result.logits if hasattr(result, "logits") else result[0]).astype("float32").numpy())


def generate(directory, ids, new_tokens, out):
    _, model_cls, _ = classes("dense")
    model = model_cls.from_pretrained(directory, convert_from_hf=True)
    model.eval()
    rows = []
    for prompt in np.load(ids):  # one prompt at a time: no padding
        with paddle.no_grad():
            result = model.generate(input_ids=paddle.to_tensor(prompt[None]), max_new_tokens=int(new_tokens),
                                    decode_strategy="greedy_search", use_cache=True)
        rows.append((result[0] if isinstance(result, tuple) else result).numpy()[0])
    np.save(out, np.stack(rows))


def lora_model(kind, directory, adapter):
    from paddleformers.peft import LoRAModel

    _, model_cls, _ = classes(kind)
    return LoRAModel.from_pretrained(model_cls.from_pretrained(directory, convert_from_hf=True), adapter)


def lora_dump(kind, directory, adapter, out):
    state = lora_model(kind, directory, adapter).get_trainable_state_dict()
    np.savez(out, **{k: v.astype("float32").numpy() for k, v in state.items()})


def lora_logits(kind, directory, adapter, ids, out):
    model = lora_model(kind, directory, adapter)
    model.eval()
    with paddle.no_grad():
        result = model(input_ids=paddle.to_tensor(np.load(ids)))
    np.save(out, (result.logits if hasattr(result, "logits") else result[0]).astype("float32").numpy())


def image(path, out):
    """ERNIE-4.5-VL's image processor (its defaults: 56 x 56 to 28 x 28 x 1280 pixels) on an .npy image."""
    from paddleformers.transformers.ernie4_5_moe_vl.image_processor import Ernie4_5_VLImageProcessor

    processor = Ernie4_5_VLImageProcessor()
    result = processor.preprocess(images=[np.load(path)], return_tensors="np")
    np.savez(out, pixels=np.asarray(result["pixel_values"]).astype(np.float32), grid=result["image_grid_thw"],
             budget=np.array([processor.min_pixels, processor.max_pixels]))

def prepared(out, *paths):
    """ERNIE-4.5-VL's preparation of each image file (PaddleFormers' ``get_downloadable_image``), as RGB arrays."""
    from paddleformers.transformers.ernie4_5_moe_vl.vision_process import get_downloadable_image

    np.savez(out, *[np.asarray(get_downloadable_image(path, need_exif_info=False)[0]) for path in paths])


def process(tokenizer_dir, conversations, out):
    """ERNIE-4.5-VL's processor on each conversation of a JSON file ({"messages", "images", "videos", "budget"}:
    image paths, videos as lists of frame paths, pixel budgets): the chat template of the tokenizer folder,
    rendered by the tokenizer, then the processor; one OUT/<n>.npz each (what the processor returns, and the
    rendered text)."""
    from paddleformers.transformers.ernie4_5_moe_vl.image_processor import Ernie4_5_VLImageProcessor
    from paddleformers.transformers.ernie4_5_moe_vl.processor import Ernie4_5_VLProcessor
    from paddleformers.transformers.ernie4_5_moe_vl.tokenizer import Ernie4_5_VLTokenizer
    from PIL import Image

    folder = Path(tokenizer_dir)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer = Ernie4_5_VLTokenizer(vocab_file=str(folder / "tokenizer.model"),
                                     additional_special_tokens=config["additional_special_tokens"],
                                     chat_template=config["chat_template"])
    for n, case in enumerate(json.loads(Path(conversations).read_text())):
        processor = Ernie4_5_VLProcessor(image_processor=Ernie4_5_VLImageProcessor(), tokenizer=tokenizer,
                                         **case["budget"])
        text = tokenizer.apply_chat_template(case["messages"], tokenize=False, add_generation_prompt=False)
        images = [Image.open(p) for p in case["images"]]
        videos = [[Image.open(p) for p in frames] for frames in case["videos"]]
        result = processor(text=[text], images=images or None, videos=videos or None)
        arrays = {k: np.asarray(v) for k, v in result.items() if k in ("input_ids", "token_type_ids", "position_ids",
                                                                        "grid_thw", "images", "image_type_ids")}
        np.savez(Path(out) / f"{n}.npz", text=np.array(text), **arrays)


def _vl_tokenizer(tokenizer_dir):
    from paddleformers.transformers.ernie4_5_moe_vl.tokenizer import Ernie4_5_VLTokenizer

    folder = Path(tokenizer_dir)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    return Ernie4_5_VLTokenizer(vocab_file=str(folder / "tokenizer.model"),
                                additional_special_tokens=config["additional_special_tokens"],
                                chat_template=config.get("chat_template"))


def pieces(tokenizer_dir, cases, out):
    """ERNIE-4.5-VL's processor fed piece by piece: each case {"budget", "pieces"} with pieces ["text", TEXT,
    TRAINED], ["image", PATH] or ["video", [FRAME PATHS]], through the processor's own text, image and video
    steps; OUT/<n>.npz: its outputs and which tokens are trained (a trained piece's)."""
    from paddleformers.transformers.ernie4_5_moe_vl.image_processor import Ernie4_5_VLImageProcessor
    from paddleformers.transformers.ernie4_5_moe_vl.processor import Ernie4_5_VLProcessor
    from PIL import Image

    tokenizer = _vl_tokenizer(tokenizer_dir)
    for n, case in enumerate(json.loads(Path(cases).read_text())):
        processor = Ernie4_5_VLProcessor(image_processor=Ernie4_5_VLImageProcessor(), tokenizer=tokenizer,
                                         **case["budget"])
        outputs = {"input_ids": [], "token_type_ids": [], "position_ids": [], "images": [], "grid_thw": [],
                   "image_type_ids": [], "cur_position": 0, "pic_cnt": 0, "video_cnt": 0}
        trained = []
        for kind, value, *rest in case["pieces"]:
            before = len(outputs["input_ids"])
            if kind == "text":
                processor._add_text(value, outputs)
            elif kind == "image":
                processor._add_image(Image.open(value), outputs)
            else:
                processor._add_video([Image.open(p) for p in value], outputs)
            trained += [kind == "text" and bool(rest[0])] * (len(outputs["input_ids"]) - before)
        for key in ("cur_position", "pic_cnt", "video_cnt"):
            outputs.pop(key)
        packed = processor._pack_outputs(outputs)
        np.savez(Path(out) / f"{n}.npz", trained=np.array(trained, bool),
                 **{k: np.asarray(v) for k, v in packed.items()})


def frames(cases, out):
    """Which frames ERNIE-4.5-VL's processor samples from a video of N frames lasting S seconds, at its defaults
    (2 per second, 16 to 180 frames, the middle of each interval): its own argument rules, then its sampler."""
    from paddleformers.transformers.ernie4_5_moe_vl.processor import Ernie4_5_VLProcessor
    from paddleformers.transformers.ernie4_5_moe_vl.vision_process import get_frame_indices

    result = []
    for count, seconds in json.loads(Path(cases).read_text()):
        args = {"fps": 2, "min_frames": 16, "max_frames": 180, "target_frames": -1, "frames_sample": "middle"}
        args = Ernie4_5_VLProcessor._set_video_frame_args(None, args, {"duration": seconds})
        result.append([int(i) for i in get_frame_indices(count, target_frames=args["target_frames"],
                                                         frames_sample="middle")])
    Path(out).write_text(json.dumps(result))


def timestamps(frames, times, font, out):
    """ERNIE-4.5-VL's processor's time mark (``render_frame_timestamp``) on each frame (``[N, H, W, 3]`` .npy) at
    each time (JSON seconds), with FONT in place of the Roboto file its package does not include."""
    from paddleformers.transformers.ernie4_5_moe_vl import vision_process
    from PIL import Image

    vision_process.render_single_image_with_timestamp.__defaults__ = (font,)
    drawn = [np.asarray(vision_process.render_frame_timestamp(Image.fromarray(frame), t))
             for frame, t in zip(np.load(frames), json.loads(Path(times).read_text()))]
    np.save(out, np.stack(drawn))


def vl_logits(directory, out, *processed, adapter=None):
    """``Ernie4_5_VLMoeForConditionalGeneration``'s logits on the processor's output for each conversation, its
    uint8 pixels normalised as its model expects them (rescaled, the image processor's mean and std, bfloat16).
    Its router losses are off: their kernel (``cal_aux_loss``) is GPU-only and they do not enter the logits.
    With ``adapter``, through ``LoRAModel.from_pretrained``, whose LoRA tensors go to OUT/lora_state.npz."""
    import paddleformers_cpu
    from paddleformers.transformers.ernie4_5_moe_vl.image_processor import Ernie4_5_VLImageProcessor

    paddleformers_cpu.install()
    _, model_cls, _ = classes("vl")
    model = _with_adapter(model_cls.from_pretrained(directory, convert_from_hf=True, router_aux_loss_coef=0.0),
                          adapter, out)
    model.eval()
    image_processor = Ernie4_5_VLImageProcessor()
    mean, std = (np.asarray(v, np.float32)[None, :, None] for v in (image_processor.image_mean,
                                                                    image_processor.image_std))
    for path in processed:
        np.save(Path(out) / f"{Path(path).stem}.npy", _vl_logits(model, np.load(path), image_processor, mean, std))


def _with_adapter(model, adapter, out):
    """``model``, or with ``adapter`` the model ``LoRAModel.from_pretrained`` makes of it (its layers adapted in
    place), whose LoRA tensors go to OUT/lora_state.npz."""
    if adapter is None:
        return model
    from paddleformers.peft import LoRAModel

    state = LoRAModel.from_pretrained(model, adapter).get_trainable_state_dict()
    np.savez(Path(out) / "lora_state.npz", **{k: v.astype("float32").numpy() for k, v in state.items()})
    return model


def _vl_logits(model, data, image_processor, mean, std):
    media = {}
    if data["images"].size:
        pixels = data["images"].astype(np.float32).reshape(len(data["images"]), 3, -1) * image_processor.rescale_factor
        pixels = ((pixels - mean) / std).reshape(data["images"].shape)
        media = dict(images=paddle.to_tensor(pixels).astype("bfloat16"), grid_thw=paddle.to_tensor(data["grid_thw"]),
                     image_type_ids=paddle.to_tensor(data["image_type_ids"]))
    types = np.concatenate([data["token_type_ids"], data["token_type_ids"][:, -1:]], axis=1)  # + the label's
    with paddle.no_grad():
        result = model(input_ids=paddle.to_tensor(data["input_ids"]), token_type_ids=paddle.to_tensor(types),
                       position_ids=paddle.to_tensor(data["position_ids"]), return_dict=True, **media)
    return result.logits.astype("float32").numpy()


def vl_mtp(directory, out, *processed, adapter=None):
    """The multi-token prediction of ``Ernie4_5_VLMoeForConditionalGeneration`` (a folder with
    ``num_nextn_predict_layers``) on the processor's output for each conversation: its decoder runs the first
    S - depths tokens and each depth the tokens after them, as PaddleFormers trains MTP. Each depth's logits go to
    OUT/<stem>_mtp.npy ``[depths, S - depths, vocab]``, and its loss, as PaddleFormers' criterion computes a depth's
    (the mean cross-entropy of its labels), to OUT/<stem>_mtp.json. The VL model's forward does not pass on the
    packing offsets its decoder asks for with MTP (zeros: one document), hands its decoder the token types of the
    whole sequence where its layers route the shortened one, and does not return the depths' hidden states: all
    three are done here around its decoder. With ``adapter``, through ``LoRAModel.from_pretrained`` (see
    :func:`vl_logits`)."""
    import paddleformers_cpu
    from paddleformers.transformers.ernie4_5_moe_vl.image_processor import Ernie4_5_VLImageProcessor
    from paddleformers.transformers.ernie4_5_moe_vl.model.modeling_moe import ErniePretrainingCriterionBase

    paddleformers_cpu.install()
    _, model_cls, _ = classes("vl")
    model = _with_adapter(model_cls.from_pretrained(directory, convert_from_hf=True, router_aux_loss_coef=0.0),
                          adapter, out)
    model.eval()
    depths = model.config.num_nextn_predict_layers
    seen = []

    class WithOffsets(type(model.model)):
        def forward(self, *args, **kwargs):
            kwargs["nbatch_pack_offset"] = paddle.zeros(kwargs["inputs_embeds"].shape[:2], dtype="int64")
            types = kwargs["token_type_ids"]  # its layers route by them: those of the shortened sequence
            kwargs["token_type_ids"] = types[:, : types.shape[1] - depths]
            seen.append(super().forward(*args, **kwargs).mtp_outputs)
            raise Captured  # the head after it reads the shortened sequence with the whole one's token types

    model.model.__class__ = WithOffsets
    criterion = ErniePretrainingCriterionBase(model.config)
    image_processor = Ernie4_5_VLImageProcessor()
    mean, std = (np.asarray(v, np.float32)[None, :, None] for v in (image_processor.image_mean,
                                                                    image_processor.image_std))
    for path in processed:
        data = np.load(path)
        seen.clear()
        try:
            _vl_logits(model, data, image_processor, mean, std)
        except Captured:
            pass
        ids = data["input_ids"]
        with paddle.no_grad():
            logits = [_head_logits(model, hidden) for hidden in seen[0]]
        length = ids.shape[1] - depths
        losses = []
        for depth, depth_logits in enumerate(logits, start=1):
            # the label of position i at depth d is token i + d + 1 (PaddleFormers' labels[:, d : d + length])
            labels = paddle.to_tensor(ids[:, depth + 1: depth + 1 + length])
            labels = paddle.concat([labels, paddle.full([1, length - labels.shape[1]], -100, labels.dtype)], axis=1)
            loss, _ = criterion(depth_logits, labels, (labels != -100).astype("float32"))  # its data's loss mask
            losses.append(float(loss))
        np.save(Path(out) / f"{Path(path).stem}_mtp.npy", np.stack([t.astype("float32").numpy()[0] for t in logits]))
        (Path(out) / f"{Path(path).stem}_mtp.json").write_text(json.dumps({"losses": losses}))


class Captured(Exception):
    """The depths' hidden states are in: the forward stops there."""


def _head_logits(model, hidden):
    """The text logits as its head computes them (``calc_multimodal_logits`` without an image head), which it asks the
    label token types for: those of the whole sequence, not the shortened one's."""
    head = model.lm_head
    logits = paddle.matmul(hidden, head.weight, transpose_y=model.config.tie_word_embeddings)
    return logits if head.bias is None else logits + head.bias


def dpo(directory, pairs, out):
    """PaddleFormers' DPO on pairs of token ids (PAIRS .npz: prompt_i, chosen_i, rejected_i, reference [n, 2],
    beta, loss_type, dpop_lambda): its model's logits of prompt + chosen and of prompt + rejected, laid out as its
    DPO data is (``prompt | chosen | last prompt token, rejected``: the logits of each position as the plain
    forward of its side gives them), its labels and response indices (``ignore_eos_token``: the rejected answer
    starts one after the chosen answer's last position), then ``DPOCriterion`` with the given reference."""
    from types import SimpleNamespace

    from paddleformers.transformers.dpo_criterion import DPOCriterion

    data = np.load(pairs)
    _, model_cls, _ = classes("dense")
    model = model_cls.from_pretrained(directory, convert_from_hf=True)
    model.eval()
    rows, chosen_labels, rejected_labels, indices = [], [], [], []
    count = len(data["reference"])
    for i in range(count):
        prompt, chosen, rejected = (data[f"{k}_{i}"] for k in ("prompt", "chosen", "rejected"))
        with paddle.no_grad():
            a, b = (model(input_ids=paddle.to_tensor(np.concatenate([prompt, side])[None])).logits[0].numpy()
                    for side in (chosen, rejected))
        n, c = len(prompt), len(chosen)
        rows.append(np.concatenate([a, b[n - 1:]]))
        labels = np.zeros([2, len(rows[-1])], np.int64)
        labels[0, n - 1: n + c - 1] = chosen
        labels[1, n + c: n + c + len(rejected)] = rejected
        chosen_labels.append(labels[0])
        rejected_labels.append(labels[1])
        indices.append([i, n - 1, n + c - 1, n + c + len(rejected)])
    width = max(len(r) for r in rows)
    pad = [(0, width - len(r)) for r in rows]
    logits = paddle.to_tensor(np.stack([np.pad(r, (p, (0, 0))) for r, p in zip(rows, pad)]).astype("float32"))
    chosen_labels, rejected_labels = (paddle.to_tensor(np.stack([np.pad(v, p) for v, p in zip(labels, pad)]))
                                      for labels in (chosen_labels, rejected_labels))
    config = SimpleNamespace(tensor_parallel_output=False, tensor_model_parallel_size=1)
    dpo_config = SimpleNamespace(loss_type=str(data["loss_type"]), beta=float(data["beta"]), label_smoothing=0.0,
                                 dpop_lambda=float(data["dpop_lambda"]), pref_loss_ratio=1.0, sft_loss_ratio=0.0,
                                 normalize_logps=False, simpo_gamma=0.0)
    criterion = DPOCriterion(config, dpo_config, ignore_eos_token=True)
    reference = paddle.to_tensor(data["reference"].astype("float32"))
    chosen, rejected, _, loss, _ = criterion(logits, (chosen_labels, rejected_labels,
                                                      paddle.to_tensor(np.array(indices, np.int64)),
                                                      reference[:, 0], reference[:, 1]))
    np.savez(out, chosen=chosen.numpy(), rejected=rejected.numpy(), loss=float(loss))


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"make": make, "dump": dump, "logits": logits, "generate": generate, "lora_logits": lora_logits,
     "lora_dump": lora_dump, "image": image, "prepared": prepared, "process": process,
     "pieces": pieces,
     "frames": frames, "timestamps": timestamps, "vl_logits": vl_logits, "vl_mtp": vl_mtp, "dpo": dpo,
     "vl_lora": lambda base, adapter, out, *cases: vl_logits(base, out, *cases, adapter=adapter),
     "vl_mtp_lora": lambda base, adapter, out, *cases: vl_mtp(base, out, *cases, adapter=adapter)}[command](*args)
