"""Error types for mistakes a user can make. The CLI prints them without a traceback."""


class RollError(Exception):
    """Base class for errors caused by user input (recipe, command line, data, model path)."""


class ConfigError(RollError, ValueError):
    """A recipe or command-line value is unknown, has the wrong type, or conflicts with another."""


class DataError(RollError, ValueError):
    """A dataset file or row cannot be used; the message names the file and row."""


class ModelError(RollError, ValueError):
    """A model path, architecture or checkpoint cannot be used as configured."""
