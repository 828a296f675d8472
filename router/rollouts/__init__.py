"""Routes, A/B tests, canaries (their routing), shadows, rate limits, public names.  Canary
statistics and judgement are the control plane's (``control_plane.rollouts``)."""
