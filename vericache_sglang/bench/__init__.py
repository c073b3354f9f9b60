"""Benchmarks behind `vericache bench`; configs and results live in benchmarks/."""
