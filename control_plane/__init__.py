"""Control plane: the only writer of what is loaded on which Triton server."""
