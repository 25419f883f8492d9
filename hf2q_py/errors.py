"""User-facing errors: the CLI prints these as one line, without a traceback."""


class Hf2qError(Exception):
    """Bad input or an unsupported setup, with a message that names the problem."""


class ModelLoadError(Hf2qError):
    """A model source could not be found, read or understood."""


class UnsupportedModelError(Hf2qError):
    """The model's architecture or cache cannot do what was asked."""
