"""The error every checkpoint reader raises."""


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded or written; the message names the file or tensor."""
