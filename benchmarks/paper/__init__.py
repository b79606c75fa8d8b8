"""The paper's experiments, reproduced."""
