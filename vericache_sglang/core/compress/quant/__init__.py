"""Quantizing compressors: every token kept, at fewer bits; ``quant`` holds the shared integer
quantizers they build on."""
