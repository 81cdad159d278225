"""The KV cache: the prefix cache, the context store and the decode graph's driver, host or device."""
