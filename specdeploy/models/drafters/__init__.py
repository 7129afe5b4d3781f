"""Drafter modules: EAGLE-3 and MTP heads (see docs/interfaces.md for the forward contract)."""
