"""The one error a config raises."""


class ConfigError(ValueError):
    """A config the trainer cannot run; the message says what to change."""
