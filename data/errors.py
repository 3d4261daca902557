"""The one error type of the data pipeline."""

from shardzoo.errors import UserError


class DataError(UserError):
    """Bad data input: a missing file or column, an empty dataset, too little data, a bad tokenizer."""
