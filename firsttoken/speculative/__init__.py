"""Speculative decoding: proposers of draft tokens (the model verifies them in one step).

The engine asks its proposer after each step's update for the next step's drafts; the
scheduler only consumes them.
"""
