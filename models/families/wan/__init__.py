"""Wan 2.1 and 2.2 video: the adapter, its attention processors, prompt encoding, projection reuse."""
