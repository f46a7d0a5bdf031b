"""What the SPMD fork server (tests/spmd_runs.py `PRELOAD`) imports beyond torch and diffusers' top level: every
dedicated family's adapter module and its diffusers pipeline class, whose module brings the transformers classes
of its text encoders. diffusers and transformers import these lazily, on first use: without this, each rank of each
of the ~150 groups the tests start spent 1-2 s of a core importing them again (measured: 2.0 s for six families'
pipelines and encoders in a fresh interpreter). Imports only: no torch op runs here (`spmd_runs._fork_server`)."""

import importlib

import diffusers

from diffusiond.models.families.specs import FAMILIES

for _family in FAMILIES.values():
    getattr(diffusers, _family.pipeline_class)
    module, _, _ = _family.adapter.partition(":")
    importlib.import_module(f"diffusiond.models.{module}")
