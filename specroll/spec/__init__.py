"""Speculative-decoding algorithms as pure tensor functions (no model, no engine)."""
