"""Adapters that put kvguard's pool inside inference engines (each imports its engine)."""
