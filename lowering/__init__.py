"""Inductor integration of csa::compressor (imported by csa_ops when available)."""
