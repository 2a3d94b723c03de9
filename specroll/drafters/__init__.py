"""Drafters: propose tokens for the verifier (one file each, one small interface in base.py)."""
