"""Structured outputs: grammar-constrained decoding (JSON schema, regex, choice, grammar)."""
