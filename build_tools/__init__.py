"""Helpers that setup.py uses to build the native library."""
