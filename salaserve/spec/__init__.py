"""Speculative decoding: drafters propose tokens, one target forward verifies them exactly."""
