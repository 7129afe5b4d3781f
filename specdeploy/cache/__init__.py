"""Caches declared by cached ops (resource handlers), their allocation, and per-step metadata."""
