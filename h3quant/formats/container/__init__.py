"""The safetensors container: the validating reader, the streaming writer, atomic outputs, checkpoints
(single file, shard index or directory), dtype names and JSON parsing of untrusted headers."""
