"""The job as a spec for another engine: `python -m mgpu.export kubernetes <overrides>`."""
