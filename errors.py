"""The base of every error caused by what a user gave (a flag, a file, a config value).

The command line catches ``UserError`` once, prints its one-line message and exits with
status 2; anything else is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """Bad input from the user; the message names what the user controls."""


class ConfigError(UserError):
    """A bad training setting: a flag value, a --config file or a key in it."""


class EnvironmentFault(RuntimeError):
    """The machine failed the command (a full disk, a lost file system), not the user's input.

    The command line prints its one-line message and exits with status 1.
    """
