"""The dedicated families: one file (or folder) each, holding only what its pipeline does differently, and what each
declares it supports (`specs`, readable without torch)."""
