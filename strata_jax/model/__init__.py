"""The Qwen3-Next forward pass as top-level functions over params and state pytrees."""
