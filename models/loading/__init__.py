"""Setting up and loading a model: the frozen setup and its rules, the registry of pipeline classes, the loader, and
weights read lazily or kept for a heal."""
