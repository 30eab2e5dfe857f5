"""Speculative decoding: proposers of draft tokens (the model verifies them in one step)."""
