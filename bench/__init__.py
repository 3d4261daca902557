"""shardzoo's benchmark suite (not part of the installed package): ``python -m bench``."""
