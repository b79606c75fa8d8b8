"""cola_jax against peer libraries."""
