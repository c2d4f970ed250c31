"""Speculative decoding: draft proposers and the speculative configuration."""
