"""The demo model: a small SD3-format text-to-image model trained here on procedural shape scenes, shipped in
`weights/` as diffusiond's default model. See README.md."""
