"""Token-dropping compressors: each keeps a subset of the prompt's tokens per layer (or head) at
full precision; ``scoring`` holds what several of them share."""
