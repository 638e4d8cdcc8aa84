"""Framework-independent parts: the native library loader (and, later, the recipes)."""
