"""The generic path: a pipeline diffusiond has no dedicated family for, served through its own call a step at a time
(`adapter`), its calls in greenlets on the step thread (`calls`), what it takes read from its signature
(`signature`), loaded as a classic or a Modular pipeline (`loading`)."""
