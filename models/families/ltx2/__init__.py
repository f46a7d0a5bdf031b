"""LTX-2: video with sound (the adapter, and Ulysses over its two sequences)."""
