"""shardzoo.data."""
