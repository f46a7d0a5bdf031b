"""What a source checkout has beside the daemon, and the wheel does not ship: the demo model's training recipe,
scene grammar and judge (`tools/demo/`), TeaCache calibration for a checkpoint (`calibrate.py`), and the
acceleration studies that judge the demo model's images (`accel.py`, `cache.py`, `compile.py`). Run them as
`python -m diffusiond.tools.NAME`; nothing in the daemon imports them."""
