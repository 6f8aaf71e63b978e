"""Host-side engine: batch slots, sampling, conversation cache, prefix block cache."""
