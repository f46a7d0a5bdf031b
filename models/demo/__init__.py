"""The demo model: a small SD3-format text-to-image model trained on procedural shape scenes, shipped in `weights/`
as diffusiond's default model (models/default.py). How it was made, and the tools that train and judge it:
tools/demo/README.md (in a source checkout; the wheel ships the weights only)."""
