"""shardzoo.train."""
