"""Router: the public, Triton-compatible endpoint in front of the fleet."""
