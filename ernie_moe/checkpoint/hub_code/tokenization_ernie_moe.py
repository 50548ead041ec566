"""The SentencePiece tokenizer of an ERNIE-4.5-VL model folder written by ernie_moe, for transformers'
``AutoTokenizer`` with ``trust_remote_code``: text cut at the special tokens, SentencePiece over the rest, no
token added around it, as the training encoded it."""

import os
import shutil

import sentencepiece
from transformers import PreTrainedTokenizer


class Ernie4_5_VLTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tokenizer.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token=None, eos_token=None, unk_token=None, pad_token=None, **kwargs):
        self.vocab_file = vocab_file
        self.sp_model = sentencepiece.SentencePieceProcessor(model_file=vocab_file)
        added = {str(getattr(t, "content", t.get("content") if isinstance(t, dict) else t))
                 for t in (kwargs.get("added_tokens_decoder") or {}).values()}
        added |= set(map(str, kwargs.get("additional_special_tokens") or kwargs.get("extra_special_tokens") or []))

        def piece(index, given, ernie):
            # ERNIE's sentence markers, where the folder has them, are the begin and end (as the training read them)
            if given is not None:
                return given
            return ernie if ernie in added else self.sp_model.id_to_piece(index) if index >= 0 else None

        super().__init__(bos_token=piece(self.sp_model.bos_id(), bos_token, "<|begin_of_sentence|>"),
                         eos_token=piece(self.sp_model.eos_id(), eos_token, "<|end_of_sentence|>"),
                         unk_token=piece(self.sp_model.unk_id(), unk_token, None),
                         pad_token=piece(self.sp_model.pad_id(), pad_token, None), **kwargs)

    @property
    def vocab_size(self):
        return self.sp_model.get_piece_size()

    def get_vocab(self):
        vocab = {self.sp_model.id_to_piece(i): i for i in range(self.vocab_size)}
        vocab.update(self.added_tokens_encoder)
        return vocab

    def _tokenize(self, text, **kwargs):
        return self.sp_model.encode(text, out_type=str)

    def _convert_token_to_id(self, token):
        return self.sp_model.piece_to_id(token)

    def _convert_id_to_token(self, index):
        return self.sp_model.id_to_piece(index)

    def convert_tokens_to_string(self, tokens):
        return self.sp_model.decode(tokens)

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        return token_ids_0 + (token_ids_1 or [])

    def save_vocabulary(self, save_directory, filename_prefix=None):
        target = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tokenizer.model")
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            shutil.copyfile(self.vocab_file, target)
        return (target,)
