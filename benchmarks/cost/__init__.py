"""What cola_jax costs on a model: compile time, memory, step time."""
