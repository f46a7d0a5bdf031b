"""What every flow-matching family shares: the adapter and its step, request resolution, the parallel wiring, video
clips, per-request samplers and the prompt cache."""
