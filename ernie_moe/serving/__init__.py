"""Answering conversations with a trained model: the OpenAI-compatible server, its page and the terminal chat."""
