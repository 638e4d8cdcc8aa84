"""``python -m transformer_engine``: print the version and the native library's status."""

import transformer_engine

print(f"transformer_engine {transformer_engine.__version__}")
print(transformer_engine.native_status())
