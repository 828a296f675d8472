"""The warm (host DRAM) and cold (local directory / S3) tiers of model artifacts."""
