"""diffusiond: a serving daemon for diffusion models."""

__version__ = "0.1.0"
