"""Benchmarks and reproductions of cola_jax: see benchmarks/README.md."""
