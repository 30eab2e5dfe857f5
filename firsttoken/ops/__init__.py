"""Numerical building blocks of the models, each fast path beside its plain reference."""
