"""Shared helpers for kvtier tests."""
