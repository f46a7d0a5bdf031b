"""Step caches: the methods and their settings, and the families' cached forwards."""
