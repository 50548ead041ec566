"""Samples into what the model reads: tokenizers, images and videos into patches, and packed rows of tokens."""
