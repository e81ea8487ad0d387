"""Tooling outside the installed package: building the embedded corpus, the benchmark."""
