"""LoRA: adapter files and the registry of adapters resident for requests."""
