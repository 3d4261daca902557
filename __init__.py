"""shardzoo: a Flax (linen) model zoo with pluggable sharding rules."""

__version__ = "0.1.0"
