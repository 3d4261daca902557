"""The run's input and output: model sources, HF and LoRA import and export, checkpoints,
run directories and metadata, the Hub."""
