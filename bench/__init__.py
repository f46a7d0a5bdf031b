"""Benchmarks (`diffusiond bench ...`) and load tools. Not a runtime module: the daemon never imports this package;
the CLI imports it only for its `bench` commands."""
