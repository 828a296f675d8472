"""Routes, A/B tests, canaries and their statistics, shadows, rate limits, public names."""
