"""The admin API (loopback, token): model control, registry, adapters, rollouts, and the router workers' data-plane API."""
